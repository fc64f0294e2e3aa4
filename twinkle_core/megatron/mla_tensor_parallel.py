"""Multi-latent attention under tensor parallelism: the shared rotary key gets its whole gradient on every rank.

megatron-core 0.16's MLA (`MLASelfAttention.get_query_key_value_tensors`) with the local spec splits
`linear_kv_down_proj` column-wise, all-gathers its output (the kv latent and the rotary key `k_pos_emb`,
which every head shares) and expands `k_pos_emb` into this rank's heads only. So each rank's gradient of
`k_pos_emb` is a partial sum over its own heads, and the gather's backward keeps only this rank's column
slice of it: the other ranks' heads' contributions are lost (megatron issue NVIDIA/Megatron-LM#1699). The
kv latent part is fine: `linear_kv_up_proj` (column-parallel) already all-reduces its input gradient.

The fix hooks `linear_kv_down_proj` and hands megatron its output already gathered, which takes megatron's
branch for a replicated latent (the Transformer-Engine spec's duplicated linear):
- with sequence parallelism the hook scatters the latent along the sequence, and megatron's branch gathers
  `k_pos_emb` back over the sequence, whose backward reduce-scatters: the heads' partial sums are added;
- without it that branch adds nothing, so the hook passes `k_pos_emb` through `_SumGradientOverGroup`
  (identity forward, all-reduce of the gradient over tp). Not megatron's `copy_to_tensor_model_parallel_region`:
  its backward all-reduces `grad.contiguous()` and returns `grad`, so a non-contiguous gradient (this one
  is a column slice) comes back unreduced (measured: the all-reduce changed nothing).
The weights, their names and the forward values are unchanged.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def sum_rotary_key_gradients(model) -> None:
    """Hook every MLA layer's split kv down-projection of `model` (one rank's chunk); no-op at tp=1."""
    from megatron.core.tensor_parallel import ColumnParallelLinear
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    for module in model.modules():
        if isinstance(module, MLASelfAttention) and isinstance(module.linear_kv_down_proj, ColumnParallelLinear) \
                and module.linear_kv_down_proj.tp_group.size() > 1:
            module.linear_kv_down_proj.register_forward_hook(_gathered_latent)


def _gathered_latent(module, args, output):
    """The whole [kv latent | rotary key] on every rank (under sequence parallelism: this rank's rows)."""
    from megatron.core.tensor_parallel import (gather_from_tensor_model_parallel_region,
                                               scatter_to_sequence_parallel_region)

    latent, bias = output
    group = module.tp_group
    latent = gather_from_tensor_model_parallel_region(latent, group=group)
    config = module.config
    if config.sequence_parallel:
        return scatter_to_sequence_parallel_region(latent, group=group), bias
    kv, rotary_key = torch.split(latent, [config.kv_lora_rank, config.qk_pos_emb_head_dim], dim=-1)
    return torch.cat([kv, _SumGradientOverGroup.apply(rotary_key, group)], dim=-1), bias


class _SumGradientOverGroup(torch.autograd.Function):
    """Identity forward; backward adds up the ranks' partial gradients of a tensor every rank holds whole."""

    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone(memory_format=torch.contiguous_format)  # all_reduce works in place on dense memory
        dist.all_reduce(grad, group=ctx.group)
        return grad, None
