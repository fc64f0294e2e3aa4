"""Packed documents and context parallelism for Transformer Engine's attention (GPU only).

Packed rows (several documents per row) reach megatron as the project writes them: position_ids that restart
at 0 for each document (SFT packing, twinkle_core.data.packing), or a 4-D block-causal mask with running
positions (pre-training's document masks). The local spec takes the mask as is; Transformer Engine takes
the `thd` format instead: every row of the micro-batch laid end to end as one sequence, and `cu_seqlens`,
the cumulative document boundaries, in a `PackedSeqParams`. Its fused attention keeps each document to
itself and megatron's RoPE restarts at each boundary; RoPE depends only on relative positions, so this
equals the running positions of the masked layout.

Context parallelism splits every sequence into 2 x cp chunks and gives cp rank r the chunks r and
2cp - 1 - r (megatron's `get_batch_on_this_cp_rank`), so each rank has equal causal work.

The boundary builders are pure functions on CPU tensors (tested exactly); the rest runs on the GPU.
"""
from __future__ import annotations

import torch


def document_starts_from_positions(position_ids: torch.Tensor) -> torch.Tensor:
    """[b, s] bool: True where a document starts (position 0), each row starting one.

    collate pads packed rows with position 0; a trailing run of zeros is made one segment (its first token
    starts it): nothing trains there, and a real one-token document at the row's end only attends to itself.
    """
    starts = position_ids == 0
    starts[:, 0] = True
    length = position_ids.shape[1]
    steps = torch.arange(length, device=position_ids.device)
    nonzero = torch.where(position_ids != 0, steps, torch.full_like(steps, -1)).amax(dim=1)  # [b]
    return starts & ~(steps[None, :] > (nonzero[:, None] + 1))


def document_starts_from_mask(mask: torch.Tensor) -> torch.Tensor:
    """[b, s] bool from a block-causal [b, 1, s, s] mask (bool: True = masked; float: 0 = attend): a
    position starts a document when the first key it may attend to is itself."""
    allowed = ~mask[:, 0] if mask.dtype == torch.bool else mask[:, 0] == 0
    first = allowed.to(torch.int8).argmax(dim=-1)  # [b, s] the first key each query sees
    return first == torch.arange(mask.shape[-1], device=mask.device)


def cu_seqlens_from_starts(starts: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The rows of `starts` [b, s] laid end to end: int32 cumulative boundaries [0, ..., b*s], and the
    longest segment (TE's max_seqlen)."""
    flat = starts.clone()
    flat[:, 0] = True  # a document never runs across rows
    begins = torch.nonzero(flat.flatten()).flatten()
    cu_seqlens = torch.cat([begins, torch.tensor([flat.numel()], device=begins.device)]).to(torch.int32)
    return cu_seqlens, int((cu_seqlens[1:] - cu_seqlens[:-1]).max())


def packed_seq_params(starts: torch.Tensor, device: torch.device):
    """megatron's PackedSeqParams (`thd`) for the rows of `starts` laid end to end."""
    from megatron.core.packed_seq_params import PackedSeqParams

    cu_seqlens, longest = cu_seqlens_from_starts(starts)
    cu_seqlens = cu_seqlens.to(device)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                           max_seqlen_q=longest, max_seqlen_kv=longest)


def split_for_context_parallel(tensors: dict[str, torch.Tensor], cp_size: int, cp_rank: int) -> dict:
    """This cp rank's two balanced chunks of each [b, s] tensor (s a multiple of 2 x cp_size)."""
    if cp_size == 1:
        return dict(tensors)
    out = {}
    for name, tensor in tensors.items():
        rows, length = tensor.shape[:2]
        if length % (2 * cp_size):
            raise ValueError(f"{name}: sequence length {length} is not a multiple of 2 x cp_size={2 * cp_size}.")
        chunks = tensor.reshape(rows, 2 * cp_size, length // (2 * cp_size), *tensor.shape[2:])
        index = torch.tensor([cp_rank, 2 * cp_size - 1 - cp_rank], device=tensor.device)
        out[name] = chunks.index_select(1, index).reshape(rows, -1, *tensor.shape[2:])
    return out
