"""FSDP managed by Accelerate (FSDP2 plugin): `strategy='accelerate'`, the default.

Accelerate shards, we keep the loop. `Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2,
auto_wrap_policy='transformer_based_wrap'), parallelism_config=ParallelismConfig(dp_replicate_size=dp,
dp_shard_size=fsdp))` and `accelerator.prepare(loss_module, optimizer)` do the sharding (FULL_SHARD, or
HYBRID_SHARD when dp_size > 1 too) with Accelerate's own layout: one unit per decoder layer, the
embeddings and output layer grouped, the root; `accelerator.backward` and `accelerator.clip_grad_norm_`
(DTensor-aware) drive backward and clipping. Gradient accumulation stays in the Stepper, because
Accelerate's `accumulate()` divides by the number of micro-batches and ours is exact per trained token.

Decision for CPU: Accelerate enables its FSDP plugin only on GPU-like devices, so in CPU processes the
same Accelerate FSDP2 path is switched on by one isolated patch (`accelerate_cpu.py`) instead of being
replaced by our own `fully_shard` calls. The CPU tests therefore exercise the code a GPU run executes, and
the accelerate and native strategies stay two real implementations that are checked against each other.
The mixed precision policy is ours (`fsdp.mixed_precision_policy`: bf16 compute, fp32 gradient reduction)
and the Accelerator itself runs with mixed_precision='no', so autocast is applied once, by the model.
Expert parallelism: the sharded experts modules are the plugin's `ignored_modules` (FSDP2 ignored_params).
"""
from __future__ import annotations

import torch
from accelerate import Accelerator
from accelerate.parallelism_config import ParallelismConfig
from accelerate.utils import FullyShardedDataParallelPlugin
from torch.distributed.fsdp import FSDPModule

from twinkle_core.parallel.expert import sharded_experts
from twinkle_core.parallel.fsdp import decoder_layer_classes, mixed_precision_policy
from twinkle_core.parallel.process_group import comm_device_type
from twinkle_core.parallel.strategy import (BuildOptimizer, DataParallelStrategy, norm_as_float, broadcast_trainable,
                                            trainable)


class AccelerateFSDP(DataParallelStrategy):
    name = "accelerate_fsdp"
    is_sharded = True
    accelerator: Accelerator | None = None

    def _make_accelerator(self, module: torch.nn.Module) -> Accelerator:
        plugin = FullyShardedDataParallelPlugin(
            fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
            transformer_cls_names_to_wrap=decoder_layer_classes(module), reshard_after_forward=True,
            mixed_precision_policy=mixed_precision_policy(self.precision), cpu_ram_efficient_loading=False,
            ignored_modules=sharded_experts(module) or None,
        )
        # sp ranks shard too (they hold other tokens): Accelerate's dp_shard ranks are then our fsdp × sp ranks
        config = ParallelismConfig(dp_replicate_size=self.mesh.size("dp"),
                                   dp_shard_size=self.mesh.size("fsdp") * self.mesh.size("sp"))
        if comm_device_type() == "cuda":
            return Accelerator(mixed_precision="no", fsdp_plugin=plugin, parallelism_config=config)
        from twinkle_core.parallel.accelerate_cpu import enable_fsdp_on_cpu

        accelerator = Accelerator(mixed_precision="no", cpu=True, fsdp_plugin=plugin)
        enable_fsdp_on_cpu(accelerator, plugin, config)
        return accelerator

    def prepare(self, module: torch.nn.Module, build_optimizer: BuildOptimizer):
        if isinstance(module, FSDPModule):  # already sharded: a new optimizer only
            return module, self.accelerator.prepare(build_optimizer(trainable(module)))
        self.accelerator = self._make_accelerator(module)
        broadcast_trainable(module)
        return self.accelerator.prepare(module, build_optimizer(trainable(module)))

    def backward(self, loss: torch.Tensor) -> None:
        self.accelerator.backward(loss)

    def clip_grad_norm_(self, parameters: list[torch.nn.Parameter], max_norm: float) -> float:
        return norm_as_float(self.accelerator.clip_grad_norm_(parameters, max_norm))
