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

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

IGNORE_INDEX = -100


@dataclass(frozen=True)
class RowBlock:
    """Rows `start:stop` of a micro-batch go through adapter `adapter` (multi-tenant LoRA)."""

    adapter: str
    start: int
    stop: int

    @property
    def rows(self) -> slice:
        return slice(self.start, self.stop)


@dataclass
class MicroBatch:
    tokens: torch.Tensor  # [b, s]
    labels: torch.Tensor  # [b, s] shifted: the token each position predicts (0 where untrained)
    loss_mask: torch.Tensor  # [b, s] 1.0 where a position is trained
    attention_mask: torch.Tensor | None  # [b, 1, s, s] bool, True = masked out; None = causal
    blocks: tuple[RowBlock, ...] | None = None  # each tenant's rows (None: one model, every row)
    packed_seq_params: object | None = None  # Transformer Engine's `thd` documents (rows laid end to end)


def row_blocks(row_adapters: list[str]) -> tuple[RowBlock, ...]:
    """The runs of equal adapter names in `row_adapters` (rows sorted by tenant give one block per tenant)."""
    blocks, start = [], 0
    for i in range(1, len(row_adapters) + 1):
        if i == len(row_adapters) or row_adapters[i] != row_adapters[start]:
            blocks.append(RowBlock(row_adapters[start], start, i))
            start = i
    return tuple(blocks)


def _restarts(position_ids: torch.Tensor | None) -> bool:
    """Whether position_ids restart inside a row (packed samples with their own positions)."""
    if position_ids is None:
        return False
    expected = torch.arange(position_ids.shape[1], device=position_ids.device).expand_as(position_ids)
    return not torch.equal(position_ids.to(expected.dtype), expected)


def _megatron_attention_mask(mask: torch.Tensor | None, position_ids: torch.Tensor | None) -> torch.Tensor | None:
    """A 4-D packed-documents mask (0 = attend) as megatron's boolean one; 2-D padding needs none (causal)."""
    if position_ids is not None:
        if _restarts(position_ids):
            raise ValueError(
                "position_ids restart inside a row (packed samples with their own positions): megatron-core's "
                "local layer spec rotates by sequence position, so packed rows must keep running positions. "
                "Pack with document masks only (the pretrain data does), or train unpacked rows.")
    if mask is None or mask.dim() == 2:
        return None
    if mask.dim() != 4:
        raise ValueError(f"attention_mask: expected [batch, seq] or [batch, 1, seq, seq], got {list(mask.shape)}.")
    return mask != 0 if mask.dtype == torch.bool else mask < 0


def split_micro_batches(batch: dict, micro_batch_size: int, pad_multiple: int = 1,
                        row_adapters: list[str] | None = None, allow_ragged: bool = False,
                        packed_documents: bool = False, cp_size: int = 1, cp_rank: int = 0) -> list[MicroBatch]:
    """Shift labels over each whole row, pad the length to `pad_multiple` (sequence parallelism), cut rows.

    `row_adapters`: each row's adapter (multi-tenant LoRA); every micro-batch gets the blocks of its rows.
    `allow_ragged`: the last micro-batch may be smaller (one pipeline stage: no fixed message shapes).
    Transformer Engine: `packed_documents` turns packed rows (restarting positions or a 4-D document mask)
    into `thd` micro-batches (twinkle_core.megatron.packed); `cp_size` > 1 gives this cp rank its chunks of
    every row (the length is padded to a multiple of 2 x cp_size)."""
    if packed_documents and (_restarts(batch.get("position_ids")) or _is_4d(batch.get("attention_mask"))):
        return _packed_micro_batches(batch, micro_batch_size, pad_multiple, allow_ragged)
    if cp_size > 1:
        pad_multiple = math.lcm(pad_multiple, 2 * cp_size)
    micro_batches = _row_micro_batches(batch, micro_batch_size, pad_multiple, row_adapters, allow_ragged)
    return micro_batches if cp_size == 1 else [_context_parallel_part(m, cp_size, cp_rank) for m in micro_batches]


def _is_4d(mask: torch.Tensor | None) -> bool:
    return mask is not None and mask.dim() == 4


def _packed_micro_batches(batch: dict, micro_batch_size: int, pad_multiple: int,
                          allow_ragged: bool) -> list[MicroBatch]:
    """Each micro-batch's rows laid end to end as one `thd` sequence with its documents' boundaries."""
    from twinkle_core.megatron.packed import (document_starts_from_mask, document_starts_from_positions,
                                              packed_seq_params)

    positions = batch.get("position_ids")
    starts = document_starts_from_positions(positions) if _restarts(positions) else \
        document_starts_from_mask(batch["attention_mask"])
    plain = {k: v for k, v in batch.items() if k not in ("attention_mask", "position_ids")}
    rows = _row_micro_batches(plain, micro_batch_size, pad_multiple, None, allow_ragged)
    extra = rows[0].tokens.shape[1] - starts.shape[1]
    if extra:  # padding added for sequence parallelism: a segment of its own, in each row
        pad_starts = torch.zeros(starts.shape[0], extra, dtype=torch.bool, device=starts.device)
        pad_starts[:, 0] = True
        starts = torch.cat([starts, pad_starts], dim=1)
    out, first = [], 0
    for micro in rows:
        count = micro.tokens.shape[0]
        out.append(MicroBatch(micro.tokens.reshape(1, -1), micro.labels.reshape(1, -1),
                              micro.loss_mask.reshape(1, -1), None,
                              packed_seq_params=packed_seq_params(starts[first:first + count], micro.tokens.device)))
        first += count
    return out


def _context_parallel_part(micro: MicroBatch, cp_size: int, cp_rank: int) -> MicroBatch:
    from twinkle_core.megatron.packed import split_for_context_parallel

    if micro.attention_mask is not None:
        raise ValueError("context parallelism takes causal rows only (no document mask); use cp_size=1.")
    parts = split_for_context_parallel({"tokens": micro.tokens, "labels": micro.labels,
                                        "loss_mask": micro.loss_mask}, cp_size, cp_rank)
    return MicroBatch(parts["tokens"], parts["labels"], parts["loss_mask"], None, micro.blocks)


def _row_micro_batches(batch: dict, micro_batch_size: int, pad_multiple: int, row_adapters: list[str] | None,
                       allow_ragged: bool) -> list[MicroBatch]:
    tokens, labels = batch["input_ids"], batch["labels"]
    rows = tokens.shape[0]
    if rows % micro_batch_size and not allow_ragged:
        raise ValueError(f"the batch has {rows} rows, not a multiple of micro_batch_size={micro_batch_size}, "
                         f"which pipeline stages need (their messages have one shape); give each data-parallel "
                         f"rank a multiple of it, or micro_batch_size=1.")
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
                       None if attention is None else attention[i:i + micro_batch_size],
                       None if row_adapters is None else row_blocks(row_adapters[i:i + micro_batch_size]))
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


def make_forward_step(vocab_size: int, router=None, tenants: list[str] | None = None):
    """The `forward_step_func` of megatron's schedules: run a micro-batch, return its summed loss and tokens.

    With a LoRA `router` and the call's `tenants`, each micro-batch's row blocks go through their tenants'
    adapters, and the report also carries every tenant's summed loss and tokens (zeros where it has no rows).
    """

    def forward_step(data_iterator, model):
        micro: MicroBatch = next(data_iterator)
        positions = torch.arange(micro.tokens.shape[1], device=micro.tokens.device).expand_as(micro.tokens)
        extra = {} if micro.packed_seq_params is None else {"packed_seq_params": micro.packed_seq_params}
        if router is not None and micro.blocks is not None:
            with router.route(micro.blocks):
                logits = model(micro.tokens, positions, micro.attention_mask, **extra)
        else:
            logits = model(micro.tokens, positions, micro.attention_mask, **extra)  # [b, s, V/tp] on the last stage

        def loss_func(output: torch.Tensor):
            losses = vocab_masked_token_losses(output.contiguous(), micro.labels, vocab_size) * micro.loss_mask
            loss_sum = losses.sum()
            tokens = micro.loss_mask.sum().to(torch.int)
            report = {"loss": torch.stack([loss_sum.detach(), tokens.detach().float()])}
            if tenants is not None:
                report["tenants"] = _tenant_sums(losses.detach(), micro, tenants)
            return loss_sum, tokens, report

        return logits, loss_func

    return forward_step


def _tenant_sums(losses: torch.Tensor, micro: MicroBatch, tenants: list[str]) -> torch.Tensor:
    """[tenant, (summed loss, trained tokens)] of one micro-batch's masked per-token losses [b, s]."""
    sums = torch.zeros(len(tenants), 2, device=losses.device)
    for block in micro.blocks or ():
        index = tenants.index(block.adapter)
        sums[index, 0] += losses[block.rows].sum()
        sums[index, 1] += micro.loss_mask[block.rows].sum()
    return sums


def run_schedule(model_chunks: list, micro_batches: list[MicroBatch], vocab_size: int, forward_only: bool,
                 router=None, tenants: list[str] | None = None) -> tuple[float, int] | tuple[float, int, list]:
    """Run every micro-batch through the pipeline; (summed loss, trained tokens) of this data-parallel rank,
    and with `tenants` a third item: [(summed loss, trained tokens)] per tenant.

    The numbers live on the last pipeline stage; they are broadcast over the pipeline so every rank returns them.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    first = micro_batches[0]
    data = iter(micro_batches) if len(model_chunks) == 1 else [iter(micro_batches) for _ in model_chunks]
    reports = get_forward_backward_func()(
        forward_step_func=make_forward_step(vocab_size, router, tenants), data_iterator=data, model=model_chunks,
        # the schedule's message shapes divide the whole sequence by cp itself
        num_microbatches=len(micro_batches), seq_length=first.tokens.shape[1] * ps.get_context_parallel_world_size(),
        micro_batch_size=first.tokens.shape[0], forward_only=forward_only)
    width = 2 + 2 * len(tenants or ())
    totals = torch.zeros(width, device=first.tokens.device)
    if ps.is_pipeline_last_stage(ignore_virtual=True):
        rows = [torch.cat([r["loss"], *([r["tenants"].flatten()] if tenants else [])]) for r in reports]
        totals = torch.stack(rows).sum(0).to(first.tokens.device)
    if ps.get_pipeline_model_parallel_world_size() > 1:
        dist.broadcast(totals, src=ps.get_pipeline_model_parallel_last_rank(),
                       group=ps.get_pipeline_model_parallel_group())
    if tenants is None:
        return float(totals[0]), int(totals[1])
    per_tenant = [(float(loss), int(tokens)) for loss, tokens in totals[2:].view(-1, 2).tolist()]
    return float(totals[0]), int(totals[1]), per_tenant
