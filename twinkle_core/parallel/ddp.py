"""Plain data parallelism: a full model copy per rank, gradients all-reduced by DistributedDataParallel.

Chosen when fsdp_size = 1 (dp_size and/or sp_size > 1; sp ranks hold other tokens of the same rows, so
they all-reduce too), whatever `strategy` says: with nothing to shard, DDP is the
cheapest exchange (one bucketed all-reduce, overlapped with backward). Micro-batches before the last one
of an accumulation step run under `no_sync`, so gradients are exchanged once per optimizer step.
Expert shards (expert parallelism) are on DDP's ignore list: it neither broadcasts nor averages them.
"""
from __future__ import annotations

import contextlib

import torch
from torch.nn.parallel import DistributedDataParallel

from twinkle_core.parallel.expert import expert_parameter_names
from twinkle_core.parallel.strategy import BuildOptimizer, DataParallelStrategy, trainable


def _has_experts(module: torch.nn.Module) -> bool:
    """MoE models: a micro-batch may route no token to some expert, leaving its weights without a gradient."""
    config = getattr(getattr(module, "model", module), "config", None)
    text = config.get_text_config() if config is not None and hasattr(config, "get_text_config") else config
    return any(getattr(text, name, None) for name in ("num_experts", "n_routed_experts", "num_local_experts"))


class DDPStrategy(DataParallelStrategy):
    name = "ddp"

    def prepare(self, module: torch.nn.Module, build_optimizer: BuildOptimizer):
        if not isinstance(module, DistributedDataParallel):
            device_ids = [torch.cuda.current_device()] if torch.cuda.is_available() else None
            ignored = expert_parameter_names(module)
            if ignored:
                DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, ignored)
            # DDP broadcasts rank 0's weights here, so every replica starts equal (LoRA starts random).
            module = DistributedDataParallel(
                module, device_ids=device_ids, process_group=self.mesh.token_parallel_group,  # dp (× sp) ranks
                forward_sync_buffers=False,  # no trained buffers in these models: skip a collective per forward
                find_unused_parameters=_has_experts(module) or getattr(module, "leaves_parameters_unused", False),
            )
        return module, build_optimizer(trainable(module))

    def gradient_sync(self, module: torch.nn.Module, enabled: bool):
        if enabled or not isinstance(module, DistributedDataParallel):
            return contextlib.nullcontext()
        return module.no_sync()
