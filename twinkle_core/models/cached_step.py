"""Exact gradient accumulation for contrastive objectives: cached embeddings (GradCache, Gao et al. 2021).

In-batch negatives make N accumulated micro-batches differ from one batch N times as large: each
micro-batch would only see its own documents. Here one step's micro-batches are embedded first without
autograd (one micro-batch's activations at a time), the loss of the whole step is computed on those cached
embeddings, and its gradient with respect to each embedding is kept. Then each micro-batch runs forward
again with autograd, from the same random state (dropout), and back-propagates `embeddings · cached grad`.
The update equals one batch of the whole step, at a micro-batch's activation memory; across data-parallel
ranks the negatives of the whole global step are gathered, with their gradient.
"""
from __future__ import annotations

import torch

from twinkle_core.data.pairs import merge_pair_batches
from twinkle_core.models.batches import count_input_tokens


def _rng_state(device: torch.device):
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


def _set_rng_state(state, device: torch.device) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


def cached_forward_backward(model, chunks: list[dict]) -> float:
    """Forward and backward one step made of `chunks` (this rank's collated micro-batches); return the mean
    loss of this rank's queries. `model` is a TransformersModel whose objective can embed."""
    stepper = model._require_optimizer("forward_backward")
    model.model.train()
    runner = model._loss_module()
    batches = [model._batch(chunk) for chunk in chunks]
    stepper.start_micro_batch()
    states, queries, docs = [], [], []
    with torch.no_grad():
        for batch in batches:
            states.append(_rng_state(model.device))
            with model.precision.autocast(model.device.type):
                q, d = runner(batch, embed_only=True)
            queries.append(q)
            docs.append(d)
    merged, positive_at, negative_at = merge_pair_batches(batches)
    rows = [len(batch["query_key"]) for batch in batches]
    all_queries = torch.cat(queries).requires_grad_()
    all_docs = torch.cat([d[:n] for d, n in zip(docs, rows)] + [d[n:] for d, n in zip(docs, rows)]).requires_grad_()
    parts = model.objective.loss_from_embeddings(all_queries, all_docs, merged, model.data_group(),
                                                 **model.objective_options)
    query_grad, doc_grad = torch.autograd.grad(stepper.scaled(parts.loss_sum), [all_queries, all_docs])
    for i, batch in enumerate(batches):
        _set_rng_state(states[i], model.device)  # the same dropout as the cached pass
        chunk_doc_grad = torch.cat([doc_grad[positive_at[i]], doc_grad[negative_at[i]]])
        with model.parallel.gradient_sync(runner, enabled=i == len(batches) - 1):
            with model.precision.autocast(model.device.type):
                q, d = runner(batch, embed_only=True)
            surrogate = (q * query_grad[positive_at[i]]).sum() + (d * chunk_doc_grad).sum()
            stepper.parallel.backward(surrogate)
    seen = sum(count_input_tokens(batch) for batch in batches)
    stepper.record(parts.loss_sum, parts.num_tokens, seen, micro_batches=len(batches))
    return float(parts.loss_sum.detach()) / max(1, parts.num_tokens)
