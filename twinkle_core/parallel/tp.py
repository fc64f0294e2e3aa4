"""Tensor parallelism (`tp_size > 1`) for the Transformers backend, alone or under FSDP (2-D FSDP × TP).

The model loads whole on every rank; `prepare` (called by set_optimizer, after a LoRA adapter was added)
shards it with the model's own Transformers tp plan over the mesh's `tp` dim (`tp_plan.py`: for
Llama-like models q/k/v/gate/up column-wise, o/down row-wise, the embedding and the output layer split
along the vocabulary). Sharded weights are DTensors; norms stay whole and each rank updates them
identically (their gradients come out equal, every tp rank seeing the same activations).

With data parallelism next to it (dp_size and/or fsdp_size > 1) the tp-sharded model is then sharded by
`fully_shard` over the `fsdp` dim (HSDP over `dp` × `fsdp`), exactly as the native FSDP strategy does:
torch's 2-D layout, where a tp-sharded weight becomes a DTensor over (fsdp, tp). FSDP × TP is therefore
always driven by `fully_shard`, whatever `strategy` says (Accelerate's FSDP plugin is not used under TP).

Numbers: the tp ranks of one data-parallel rank share its data, so tokens and losses are summed over the
data-parallel group (dp × fsdp) only, and FSDP averages gradients over that group. The gradient norm
counts each weight once: a DTensor's norm is taken over the whole (global) tensor, a whole weight's
locally. fp16: the loss scaler unscales each rank's local gradient shards and agrees on an overflow over
all ranks (`TensorParallelGradScaler`), so every rank skips the same steps.

Not supported (refused before training with the alternative): TP with sequence or expert parallelism,
and models whose plan has styles tp_plan.py does not translate (MoE experts, MLA).
"""
from __future__ import annotations

import math

import torch
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.distributed.tensor import DTensor

from twinkle_core.parallel.strategy import BuildOptimizer, DataParallelStrategy, broadcast_trainable, trainable
from twinkle_core.parallel.tp_plan import apply_tensor_parallel, is_tensor_parallel

_NOT_WITH_TP = {"sp_size": "sequence parallelism", "ep_size": "expert parallelism"}


def tp_unsupported(sizes: dict[str, int]) -> list[str]:
    """Why a layout with tp_size > 1 cannot run (empty: TP alone or with dp/fsdp, which are supported)."""
    if sizes.get("tp_size", 1) == 1:
        return []
    return [f"tp_size={sizes['tp_size']} with {name}={sizes[name]}: tensor parallelism combined with {what} is not "
            f"supported yet; use {name}=1 (TP composes with dp_size/fsdp_size) or tp_size=1."
            for name, what in _NOT_WITH_TP.items() if sizes.get(name, 1) != 1]


def _norm_sq(grads: list[torch.Tensor]) -> float:
    total = 0.0
    for grad in grads:
        norm = torch.linalg.vector_norm(grad, 2, dtype=torch.float32)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()  # Shard placements: the norm over the whole (global) gradient
        total += float(norm.double()) ** 2
    return total


def clip_grad_norm_mixed(parameters: list[torch.nn.Parameter], max_norm: float) -> float:
    """clip_grad_norm_ for a mix of DTensors (tp- and/or fsdp-sharded) and whole weights; returns the norm."""
    grads = [p.grad for p in parameters if p.grad is not None]
    norm = math.sqrt(_norm_sq(grads))
    if math.isfinite(max_norm):
        coef = max_norm / (norm + 1e-6)
        if coef < 1.0:
            for grad in grads:
                grad.mul_(coef)
    return norm


class TensorParallelGradScaler(ShardedGradScaler):
    """fp16 loss scaling for tp-sharded, fsdp-sharded and whole gradients together.

    ShardedGradScaler already all-reduces "found inf" over all ranks; its unscale kernel, though, cannot
    take DTensors on different meshes next to plain tensors in one call. Each rank therefore unscales the
    local tensors it holds (a DTensor's shard in place), grouped by dtype.
    """

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16=True):
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for group in optimizer.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    local = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
                    by_dtype.setdefault(local.dtype, []).append(local)
        with torch.no_grad():
            for grads in by_dtype.values():
                torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale.to(found_inf.device))
        return {found_inf.device: found_inf}


class TensorParallel(DataParallelStrategy):
    """TP over the mesh's `tp` dim; under FSDP (fully_shard over `fsdp`, HSDP with `dp`) when data-parallel."""

    is_sharded = True

    def __init__(self, mesh, precision):
        super().__init__(mesh, precision)
        self.name = "tp" if mesh.data_parallel_size == 1 else "fsdp_tp"

    def prepare(self, module: torch.nn.Module, build_optimizer: BuildOptimizer):
        if not is_tensor_parallel(module):
            broadcast_trainable(module)  # before sharding: every tp group shards the same weights
            apply_tensor_parallel(module, self.mesh["tp"])
        if self.data_parallel_size > 1:
            from twinkle_core.parallel.fsdp import NativeFSDP

            return NativeFSDP(self.mesh, self.precision).prepare(module, build_optimizer)
        return module, build_optimizer(trainable(module))

    def clip_grad_norm_(self, parameters: list[torch.nn.Parameter], max_norm: float) -> float:
        return clip_grad_norm_mixed(parameters, max_norm)

    def grad_scaler(self, device_type: str) -> torch.amp.GradScaler:
        return TensorParallelGradScaler(device=device_type)
