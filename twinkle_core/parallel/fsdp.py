"""FSDP with PyTorch's own `fully_shard` (FSDP2): `strategy='native_fsdp'`.

Every decoder layer is one FSDP unit and the root unit holds the rest (embeddings, final norm, output
layer), sharded over the mesh's `fsdp` dim, or HSDP over (`dp` replicas × `fsdp` shards) when dp_size > 1.
Parameters are DTensors sharded on dim 0, so each rank keeps ~1/N of the weights, gradients and optimizer
state, and all-gathers one layer at a time for forward and backward.

Mixed precision (`MixedPrecisionPolicy` from the precision setting): bf16/fp16 gather and compute the
parameters in bf16/fp16 and reduce gradients in fp32, so the fp32 master weights the optimizer updates get
fp32 gradient sums; `no` keeps everything fp32. Frozen base weights that the bf16 policy stores in bf16 and
fp32 LoRA weights share a unit: FSDP only needs the *trainable* ones to agree on a dtype.

LoRA: only the adapter weights require grad, and `fully_shard` keeps each original parameter as its own
DTensor with its own `requires_grad` (no flat parameter, so nothing like FSDP1's use_orig_params is needed):
the optimizer sees only the adapters' shards, frozen shards get no gradient.

Expert parallelism: the expert shards are `ignored_params` of every unit (plain tensors, each rank's own).
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from twinkle_core.parallel.expert import expert_parameters
from twinkle_core.parallel.strategy import BuildOptimizer, DataParallelStrategy, broadcast_trainable, trainable


def mixed_precision_policy(precision) -> MixedPrecisionPolicy:
    """Compute in the policy's dtype, reduce gradients in fp32 (fp32 runs: no casts at all)."""
    if precision.compute_dtype == torch.float32:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=precision.compute_dtype, reduce_dtype=torch.float32)


def _hf_model(module: torch.nn.Module) -> torch.nn.Module:
    """The Transformers model inside a loss module and/or a PEFT wrapper."""
    model = getattr(module, "model", module)
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def decoder_layer_classes(module: torch.nn.Module) -> list[str]:
    """Class names of the repeated blocks: Transformers' own `_no_split_modules` list."""
    names = list(getattr(_hf_model(module), "_no_split_modules", None) or ())
    present = {type(m).__name__ for m in module.modules()}
    names = [name for name in names if name in present]
    if not names:
        raise ValueError(f"{type(_hf_model(module)).__name__} names no decoder layer class (_no_split_modules); "
                         "FSDP shards one unit per decoder layer and cannot find them.")
    return names


def decoder_layers(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers, innermost first (fully_shard wraps children before their parents)."""
    names = set(decoder_layer_classes(module))
    return [m for m in reversed(list(module.modules())) if type(m).__name__ in names]


class NativeFSDP(DataParallelStrategy):
    name = "native_fsdp"
    is_sharded = True

    def prepare(self, module: torch.nn.Module, build_optimizer: BuildOptimizer):
        if not isinstance(module, FSDPModule):
            broadcast_trainable(module)
            kwargs = dict(mesh=self.shard_mesh(), mp_policy=mixed_precision_policy(self.precision))
            if expert_parameters(module):
                kwargs["ignored_params"] = set(expert_parameters(module))
            for layer in decoder_layers(module):
                fully_shard(layer, **kwargs)
            fully_shard(module, **kwargs)
        return module, build_optimizer(trainable(module))


@contextlib.contextmanager
def whole_weights(root: torch.nn.Module) -> Iterator[None]:
    """Every FSDP unit under `root` all-gathered once and kept whole inside the block, resharded after it.

    For work outside the root's forward that runs the model a different number of times on each rank:
    generation stops at each rank's own end of sequence, so the per-forward all-gathers FSDP would otherwise
    issue would not pair up across ranks and the run would hang. Costs one full copy of the weights (in the
    compute dtype) while inside. Units resume resharding after forward (the root, as FSDP sets it, not).
    """
    units = [m for m in root.modules() if isinstance(m, FSDPModule)]
    if not units:
        yield
        return
    # The first unit to run forward becomes FSDP's root: initialise the real root before any inner forward.
    root._get_fsdp_state()._lazy_init()
    for unit in units:
        unit.set_reshard_after_forward(False, recurse=False)
        unit.unshard()
    try:
        yield
    finally:
        for unit in units:
            unit.reshard()
            unit.set_reshard_after_forward(unit is not root, recurse=False)
