"""One training (or evaluation) pass through megatron-core's pipeline schedules.

A batch arrives as the rest of the project writes it (`input_ids`, HF-style unshifted `labels` with -100
for untrained positions, a 2-D padding mask or a 4-D block-causal mask of packed documents). It is cut
into micro-batches of `micro_batch_size` rows and run by `get_forward_backward_func()`: plain
forward/backward with one pipeline stage, 1F1B with several (interleaved with virtual stages).

The loss is the project's: summed token cross-entropy over the trained positions, divided by the global
number of trained tokens (megatron's `calculate_per_token_loss`: the schedule adds the micro-batches'
token counts, `finalize_model_grads` all-reduces them over data-parallel ranks and scales the gradients
by their inverse). The padded vocabulary rows megatron adds (a multiple of 128 × tp) are masked out of the
softmax, so the loss equals the Hugging Face model's whatever the tp size.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

IGNORE_INDEX = -100


@dataclass
class MicroBatch:
    tokens: torch.Tensor  # [b, s]
    labels: torch.Tensor  # [b, s] shifted: the token each position predicts (0 where untrained)
    loss_mask: torch.Tensor  # [b, s] 1.0 where a position is trained
    attention_mask: torch.Tensor | None  # [b, 1, s, s] bool, True = masked out; None = causal


def _megatron_attention_mask(mask: torch.Tensor | None, position_ids: torch.Tensor | None) -> torch.Tensor | None:
    """A 4-D packed-documents mask (0 = attend) as megatron's boolean one; 2-D padding needs none (causal)."""
    if position_ids is not None:
        expected = torch.arange(position_ids.shape[1], device=position_ids.device).expand_as(position_ids)
        if not torch.equal(position_ids.to(expected.dtype), expected):
            raise ValueError(
                "position_ids restart inside a row (packed samples with their own positions): megatron-core's "
                "local layer spec rotates by sequence position, so packed rows must keep running positions. "
                "Pack with document masks only (the pretrain data does), or train unpacked rows.")
    if mask is None or mask.dim() == 2:
        return None
    if mask.dim() != 4:
        raise ValueError(f"attention_mask: expected [batch, seq] or [batch, 1, seq, seq], got {list(mask.shape)}.")
    return mask != 0 if mask.dtype == torch.bool else mask < 0


def split_micro_batches(batch: dict, micro_batch_size: int, pad_multiple: int = 1) -> list[MicroBatch]:
    """Shift labels over each whole row, pad the length to `pad_multiple` (sequence parallelism), cut rows."""
    tokens, labels = batch["input_ids"], batch["labels"]
    rows = tokens.shape[0]
    if rows % micro_batch_size:
        raise ValueError(f"the batch has {rows} rows, not a multiple of micro_batch_size={micro_batch_size}; "
                         f"give each data-parallel rank a multiple of it.")
    shifted = torch.full_like(labels, IGNORE_INDEX)
    shifted[:, :-1] = labels[:, 1:]
    attention = _megatron_attention_mask(batch.get("attention_mask"), batch.get("position_ids"))
    extra = -tokens.shape[1] % pad_multiple
    if extra:
        tokens = torch.nn.functional.pad(tokens, (0, extra))
        shifted = torch.nn.functional.pad(shifted, (0, extra), value=IGNORE_INDEX)
        if attention is not None:  # padded positions attend to nothing new and train nothing
            attention = torch.nn.functional.pad(attention, (0, extra, 0, extra), value=True)
    loss_mask = (shifted != IGNORE_INDEX).float()
    return [MicroBatch(tokens[i:i + micro_batch_size], shifted[i:i + micro_batch_size].clamp(min=0),
                       loss_mask[i:i + micro_batch_size],
                       None if attention is None else attention[i:i + micro_batch_size])
            for i in range(0, rows, micro_batch_size)]


def vocab_masked_token_losses(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Per-token cross-entropy over this tp rank's vocabulary slice [..., V/tp], padded rows excluded."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    local = logits.shape[-1]
    start = ps.get_tensor_model_parallel_rank() * local
    padded = torch.arange(start, start + local, device=logits.device) >= vocab_size
    if padded.any():
        logits = logits.masked_fill(padded, torch.finfo(logits.dtype).min)
    return vocab_parallel_cross_entropy(logits.float(), labels)


def make_forward_step(vocab_size: int):
    """The `forward_step_func` of megatron's schedules: run a micro-batch, return its summed loss and tokens."""

    def forward_step(data_iterator, model):
        micro: MicroBatch = next(data_iterator)
        positions = torch.arange(micro.tokens.shape[1], device=micro.tokens.device).expand_as(micro.tokens)
        logits = model(micro.tokens, positions, micro.attention_mask)  # [b, s, V/tp] on the last stage

        def loss_func(output: torch.Tensor):
            losses = vocab_masked_token_losses(output.contiguous(), micro.labels, vocab_size)
            loss_sum = (losses * micro.loss_mask).sum()
            tokens = micro.loss_mask.sum().to(torch.int)
            return loss_sum, tokens, {"loss": torch.stack([loss_sum.detach(), tokens.detach().float()])}

        return logits, loss_func

    return forward_step


def run_schedule(model_chunks: list, micro_batches: list[MicroBatch], vocab_size: int,
                 forward_only: bool) -> tuple[float, int]:
    """Run every micro-batch through the pipeline; (summed loss, trained tokens) of this data-parallel rank.

    The numbers live on the last pipeline stage; they are broadcast over the pipeline so every rank returns them.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    first = micro_batches[0]
    data = iter(micro_batches) if len(model_chunks) == 1 else [iter(micro_batches) for _ in model_chunks]
    reports = get_forward_backward_func()(
        forward_step_func=make_forward_step(vocab_size), data_iterator=data, model=model_chunks,
        num_microbatches=len(micro_batches), seq_length=first.tokens.shape[1],
        micro_batch_size=first.tokens.shape[0], forward_only=forward_only)
    totals = torch.zeros(2, device=first.tokens.device)
    if ps.is_pipeline_last_stage(ignore_virtual=True):
        totals = torch.stack([report["loss"] for report in reports]).sum(0).to(first.tokens.device)
    if ps.get_pipeline_model_parallel_world_size() > 1:
        dist.broadcast(totals, src=ps.get_pipeline_model_parallel_last_rank(),
                       group=ps.get_pipeline_model_parallel_group())
    return float(totals[0]), int(totals[1])
