"""Tensor parallelism (`tp_size > 1`) for the Transformers backend: pure TP, every rank sees the same batch.

The model is loaded with its own Transformers tp plan (`from_pretrained(...,
distributed_config=DistributedConfig(tp_plan="auto", tp_size=N))`, see TransformersModel; Transformers
5.24 builds the tp mesh itself over all ranks and ignores a `device_mesh` argument, which is one reason
only pure TP is supported): for Llama-like models q/k/v/gate/up are column-wise
(weights `Shard(0)`), o/down row-wise (`Shard(1)`), the embedding row-wise and the output layer gathers its
output, so every rank computes the full, identical loss. Sharded weights are DTensors; norms stay plain
tensors that each rank holds whole and updates identically (their gradients come out replicated).

Numbers: the tp ranks share their data, so the data-parallel group is size 1 and nothing (tokens, losses,
gradients) is summed over tp ranks. The gradient norm counts each sharded weight once (DTensor norm:
local squares summed over the tp group) and each replicated weight once (its local norm).

Supported: world == tp_size (no FSDP/DDP/SP/EP alongside) and full-parameter training; LoRA under TP and
FSDP × TP are refused with an "arrives later" message.
"""
from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor

from twinkle_core.parallel.strategy import BuildOptimizer, DataParallelStrategy, trainable


def tp_unsupported(sizes: dict[str, int]) -> list[str]:
    """Why a layout with tp_size > 1 cannot run yet (empty: pure TP, which is supported)."""
    others = {k: v for k, v in sizes.items() if k != "tp_size" and v != 1}
    if sizes.get("tp_size", 1) == 1 or not others:
        return []
    listed = ", ".join(f"{k}={v}" for k, v in others.items())
    return [f"tp_size={sizes['tp_size']} with {listed}: tensor parallelism combined with data/sequence/expert "
            "parallelism (e.g. FSDP x TP) arrives in a later release (issue 4, TP/SP/EP part); use pure TP "
            "(nproc_per_node = tp_size, every other size 1) or tp_size=1."]


def _local_norm_sq(grads: list[torch.Tensor]) -> torch.Tensor:
    total = torch.zeros((), dtype=torch.float64)
    for grad in grads:
        norm = torch.linalg.vector_norm(grad, 2, dtype=torch.float32)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()  # Shard placements: the norm over the whole (global) gradient
        total += norm.double().cpu() ** 2
    return total


def clip_grad_norm_mixed(parameters: list[torch.nn.Parameter], max_norm: float) -> float:
    """clip_grad_norm_ for a mix of DTensor (tp-sharded) and plain (replicated) parameters; returns the norm."""
    grads = [p.grad for p in parameters if p.grad is not None]
    norm = math.sqrt(float(_local_norm_sq(grads)))
    if math.isfinite(max_norm):
        coef = max_norm / (norm + 1e-6)
        if coef < 1.0:
            for grad in grads:
                grad.mul_(coef)
    return norm


class TensorParallel(DataParallelStrategy):
    """Pure tensor parallelism: the model is already sharded by from_pretrained; nothing is wrapped."""

    name = "tp"
    is_sharded = True

    def prepare(self, module: torch.nn.Module, build_optimizer: BuildOptimizer):
        if not any(isinstance(p, DTensor) for p in module.parameters()):
            raise ValueError("tp_size > 1 but the model has no tensor-parallel (DTensor) weights: load it with "
                             "from_pretrained(distributed_config=DistributedConfig(tp_plan='auto', tp_size=N)) (TransformersModel does).")
        if any(".lora_" in name for name, p in module.named_parameters() if p.requires_grad):
            raise ValueError(lora_refusal())
        return module, build_optimizer(trainable(module))

    def clip_grad_norm_(self, parameters: list[torch.nn.Parameter], max_norm: float) -> float:
        return clip_grad_norm_mixed(parameters, max_norm)

    def grad_scaler(self, device_type: str) -> torch.amp.GradScaler:
        raise ValueError("mixed_precision='fp16' with tp_size > 1 is not supported yet (its loss scaler is not "
                         "tensor-parallel aware); use mixed_precision='bf16' or 'no'.")


def lora_refusal() -> str:
    return ("LoRA under tensor parallelism (tp_size > 1) arrives in a later release (issue 4, TP/SP/EP part); "
            "train the full model with tp_size > 1, or LoRA with FSDP/DDP (tp_size=1).")
