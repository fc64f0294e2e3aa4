"""An RMSNorm for megatron's local layer spec that works under sequence parallelism.

megatron-core's local spec wraps `torch.nn.RMSNorm` and refuses `sequence_parallel` (its fused Apex and
Transformer-Engine norms are the ones that support it). Under sequence parallelism each tp rank normalises
its own slice of the sequence, so a norm weight's gradient is a partial sum: megatron all-reduces the
gradients of parameters tagged `sequence_parallel` over the tp group (`finalize_model_grads`). This norm
is torch's RMSNorm with that tag, swapped into the spec only when sequence parallelism is on. That covers
MLA's q/kv latent norms too: megatron gathers the latents whole, then scatters them along the sequence
before their norms.
"""
from __future__ import annotations

import dataclasses

import torch


class SequenceParallelRMSNorm(torch.nn.RMSNorm):
    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_megatron_norm_options):
        if config.normalization != "RMSNorm":
            raise ValueError(f"normalization={config.normalization!r}: the sequence-parallel norm here is RMSNorm.")
        super().__init__(hidden_size, eps=eps)
        self.weight.sequence_parallel = config.sequence_parallel


def use_sequence_parallel_norms(spec) -> None:
    """Replace megatron's wrapped torch norms everywhere in a (block or layer) spec, in place."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    seen: set[int] = set()

    def visit(node) -> None:
        if id(node) in seen or not dataclasses.is_dataclass(node) or isinstance(node, type):
            return
        seen.add(id(node))
        for field in dataclasses.fields(node):
            value = getattr(node, field.name)
            if value is WrappedTorchNorm:
                setattr(node, field.name, SequenceParallelRMSNorm)
            elif isinstance(value, (list, tuple)):
                for item in value:
                    visit(item)
            else:
                visit(value)

    visit(spec)
