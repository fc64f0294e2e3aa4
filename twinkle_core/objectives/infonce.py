"""The embedding objective: InfoNCE over L2-normalised, pooled text embeddings.

For each query the candidates are every document of the global micro-batch: the positives of the other
rows (in-batch negatives), every row's hard negatives, and optionally the other queries and, for the
query's positive, the other rows' documents (`same_side`, as in Qwen3-Embedding's training; equal to
sentence-transformers' MultipleNegativesRankingLoss with directions query_to_doc, query_to_query, doc_to_doc
in one joint softmax). Scores are q·d / temperature. A candidate whose text equals the positive of any row with
the same query text (the query's own included) is a false negative and masked out.

Across data-parallel ranks the embeddings are all-gathered *with* their gradient: the backward of the gather
sums every rank's gradient for the gathered embeddings and hands each rank the slice of its own, so a
passage also learns from being a negative of another rank's queries. Each rank's loss is the sum over its
own queries; the stepper divides by the global number of queries, so 2 processes equal one on the same
global batch. Negatives come from the global micro-batch: with gradient accumulation each micro-batch is its
own pool of candidates.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from twinkle_core.embedding.settings import POOLINGS
from twinkle_core.objectives.causal_lm import LossParts


def pool(hidden: torch.Tensor, attention_mask: torch.Tensor, pooling: str) -> torch.Tensor:
    """One vector per row of right-padded hidden states, in fp32: the masked mean, the first token, or the
    last real token (the EOS a last-token model was trained to summarise into)."""
    hidden = hidden.float()
    mask = attention_mask.to(hidden.dtype)
    if pooling == "mean":
        return (hidden * mask.unsqueeze(-1)).sum(1) / mask.sum(1, keepdim=True).clamp(min=1.0)
    if pooling == "cls":
        return hidden[:, 0]
    if pooling == "last":
        last = attention_mask.long().sum(1).clamp(min=1) - 1
        return hidden[torch.arange(hidden.shape[0], device=hidden.device), last]
    raise ValueError(f"pooling={pooling!r}: choose one of {', '.join(POOLINGS)}")


def embed(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
          pooling: str) -> torch.Tensor:
    """L2-normalised embeddings of a batch of texts (the model's last hidden state, pooled)."""
    hidden = model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
    return F.normalize(pool(hidden, attention_mask, pooling), dim=-1)


# ----- gathering the global micro-batch ---------------------------------------------------------------
def _all_gather_rows(x: torch.Tensor, sizes: list[int], group) -> torch.Tensor:
    """Every rank's `x` (sizes[r] rows on rank r) concatenated in rank order; no gradient."""
    padded = x.new_zeros((max(sizes), *x.shape[1:]))
    padded[:x.shape[0]] = x
    parts = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(parts, padded.contiguous(), group=group)
    return torch.cat([part[:n] for part, n in zip(parts, sizes)])


class _GatherWithGrad(torch.autograd.Function):
    """all_gather whose backward returns each rank the summed gradient of its own rows (exact)."""

    @staticmethod
    def forward(ctx, x, sizes, group):
        ctx.sizes, ctx.group = sizes, group
        return _all_gather_rows(x, sizes, group)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)  # every rank's loss depends on every rank's rows
        rank = dist.get_rank(ctx.group)
        start = sum(ctx.sizes[:rank])
        return grad[start:start + ctx.sizes[rank]], None, None


def gather_with_grad(x: torch.Tensor, sizes: list[int], group) -> torch.Tensor:
    return _GatherWithGrad.apply(x, sizes, group)


def gather_detached(x: torch.Tensor, sizes: list[int], group) -> torch.Tensor:
    """The other ranks' rows without gradient, this rank's own with it (Twinkle's gather): a passage gets no
    gradient from other ranks' queries, so training differs from one process. Kept to show that in a test."""
    gathered = _all_gather_rows(x.detach(), sizes, group)
    rank = dist.get_rank(group)
    start = sum(sizes[:rank])
    return torch.cat([gathered[:start], x, gathered[start + x.shape[0]:]])


def _global_batch(batch: dict, queries: torch.Tensor, docs: torch.Tensor, group, gather: Callable) -> dict:
    """The global micro-batch's embeddings and row bookkeeping, and where this rank's queries sit in it."""
    num_queries, num_docs = queries.shape[0], docs.shape[0]
    # Each doc belongs to a query: positives to rows 0..n-1 in order, hard negatives to their negative_row.
    doc_row = torch.cat([torch.arange(num_queries, device=docs.device), batch["negative_row"]])
    local = {"query_key": batch["query_key"], "row_valid": batch["row_valid"], "doc_key": batch["doc_key"]}
    if group is None:
        return {"queries": queries, "docs": docs, "doc_row": doc_row, "query_offset": 0, "doc_offset": 0,
                "positive": torch.arange(num_queries, device=docs.device), **local}
    sizes = _all_gather_rows(torch.tensor([[num_queries, num_docs]], device=docs.device), [1] * dist.get_world_size(
        group), group).tolist()
    query_sizes, doc_sizes = [s[0] for s in sizes], [s[1] for s in sizes]
    rank = dist.get_rank(group)
    query_offsets = [sum(query_sizes[:r]) for r in range(len(sizes))]
    doc_offsets = [sum(doc_sizes[:r]) for r in range(len(sizes))]
    # Doc rows and positives in global query / doc indices.
    doc_row = _all_gather_rows(doc_row + query_offsets[rank], doc_sizes, group)
    positive = torch.cat([torch.arange(n, device=docs.device) + doc_offsets[r] for r, n in enumerate(query_sizes)])
    return {"queries": gather(queries, query_sizes, group), "docs": gather(docs, doc_sizes, group),
            "doc_row": doc_row, "query_offset": query_offsets[rank], "doc_offset": doc_offsets[rank],
            "positive": positive, "query_key": _all_gather_rows(local["query_key"], query_sizes, group),
            "row_valid": _all_gather_rows(local["row_valid"], query_sizes, group),
            "doc_key": _all_gather_rows(local["doc_key"], doc_sizes, group)}


def _false_negatives(g: dict, rows: torch.Tensor) -> torch.Tensor:
    """(local queries × global docs): docs that must not count as negatives of each query (its own positive
    is not among them): a text equal to the positive of any row with the same query text (the query's own
    included), and the docs of stand-in rows."""
    positive_keys = g["doc_key"][g["positive"]]  # one per global row
    same_query = g["query_key"][rows][:, None] == g["query_key"][None, :]  # local × global rows
    is_positive_text = positive_keys[:, None] == g["doc_key"][None, :]  # global rows × docs
    masked = (same_query.float() @ is_positive_text.float()) > 0
    masked |= ~g["row_valid"][g["doc_row"]][None, :]
    masked[torch.arange(rows.shape[0], device=rows.device), g["positive"][rows]] = False
    return masked


def embed_pairs(model: torch.nn.Module, batch: dict, pooling: str = "mean", **_) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch's query and document embeddings (documents: the positives, then the hard negatives)."""
    queries = embed(model, batch["query_input_ids"], batch["query_attention_mask"], pooling)
    docs = embed(model, batch["doc_input_ids"], batch["doc_attention_mask"], pooling)
    return queries, docs


def infonce_from_embeddings(queries: torch.Tensor, docs: torch.Tensor, batch: dict, group=None, *,
                            temperature: float = 0.1, same_side: bool = False, gather: Callable = gather_with_grad,
                            **_) -> LossParts:
    """InfoNCE of embedded queries and documents, summed over this rank's (real) queries, and their number.
    `batch` holds the bookkeeping of collate_pairs (negative_row, the text keys, row_valid)."""
    if temperature <= 0:
        raise ValueError(f"temperature={temperature!r} must be > 0 (scores are q·d / temperature)")
    g = _global_batch(batch, queries, docs, group, gather)
    rows = torch.arange(queries.shape[0], device=docs.device) + g["query_offset"]  # this rank's global rows
    positive = g["positive"][rows]
    masked = _false_negatives(g, rows)
    scores = [(queries @ g["docs"].T).masked_fill(masked, float("-inf"))]
    if same_side:
        other_query = g["query_key"][None, :] == g["query_key"][rows][:, None]  # itself, or the same text
        other_query |= ~g["row_valid"][None, :]
        scores.append((queries @ g["queries"].T).masked_fill(other_query, float("-inf")))
        own_docs = g["doc_row"][None, :] == rows[:, None]  # the positive's own row: itself and its negatives
        scores.append((g["docs"][positive] @ g["docs"].T).masked_fill(masked | own_docs, float("-inf")))
    logits = torch.cat(scores, dim=1) / temperature
    losses = F.cross_entropy(logits, positive, reduction="none")
    valid = batch["row_valid"]
    return LossParts(losses[valid].sum(), int(valid.sum()))


def infonce_loss_sum(model: torch.nn.Module, batch: dict, router_aux_loss_coef=None, group=None, *,
                     temperature: float = 0.1, pooling: str = "mean", same_side: bool = False,
                     gather: Callable = gather_with_grad, query_prompt: str = "") -> LossParts:
    """InfoNCE summed over this rank's (real) queries, and their number (`query_prompt` is already on the
    tokenised queries; it rides along for the export)."""
    queries, docs = embed_pairs(model, batch, pooling)
    return infonce_from_embeddings(queries, docs, batch, group, temperature=temperature, same_side=same_side,
                                   gather=gather)
