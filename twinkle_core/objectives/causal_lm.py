"""The causal-LM objective (SFT and pre-training): next-token cross-entropy summed over trained tokens,
computing logits only where a label exists.

In SFT most positions are prompt tokens (label -100). Running the output layer and the log-softmax
over the whole vocabulary only at the trained positions skips that work and the fp32 logits it
would materialise; the result is the same sum as cross-entropy over all positions.

Mixture-of-experts models whose Transformers module ships a `load_balancing_loss_func` also get
the router load-balancing (auxiliary) loss, added as `coef * aux * num_tokens`: the stepper divides
summed losses by the trained tokens of the whole step, so each micro-batch's aux counts in proportion
to its trained tokens, exactly like its cross-entropy (aux itself is a statistic of that micro-batch's
routing, so it is not additive over micro-batches the way cross-entropy is). With a data-parallel
`group`, the aux is that of the global micro-batch, not of this rank's share (router_balance.py).
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F

from twinkle_core.data.device_batch import host_of, padding_free_forward, to_device_async
from twinkle_core.objectives.linear_ce import fusable_head, linear_cross_entropy_sum
from twinkle_core.objectives.router_balance import global_aux_loss_share

IGNORE_INDEX = -100


@dataclass
class LossParts:
    """One micro-batch: the summed training objective, its trained tokens, and the router aux loss."""

    loss_sum: torch.Tensor  # cross-entropy summed over trained tokens, plus coef * aux_loss * num_tokens
    num_tokens: int
    aux_loss: torch.Tensor | None = None  # detached; None when no router aux loss was computed
    # an objective's own statistics, summed over the units counted in num_tokens (e.g. DPO's rewards per pair)
    metrics: dict[str, float] | None = None

    def __iter__(self):
        # Unpacks as (loss_sum, num_tokens), the contract callers had before the aux loss existed.
        return iter((self.loss_sum, self.num_tokens))


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model under a PEFT wrapper (LoRA layers stay injected)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def has_plain_head(model: torch.nn.Module) -> bool:
    """True when logits are exactly output_layer(last_hidden_state) (no soft-capping or scaling)."""
    config = model.config
    if getattr(config, "final_logit_softcapping", None) or getattr(config, "logit_scale", None):
        return False
    try:
        return model.get_decoder() is not None and model.get_output_embeddings() is not None
    except (AttributeError, NotImplementedError):
        return False


def backbone(base: torch.nn.Module) -> torch.nn.Module:
    """The module whose last hidden state feeds the output layer. A vision-language model's `model` runs its
    vision tower and then its decoder; its get_decoder() is the text decoder alone, which ignores the pixels."""
    inner = getattr(base, "model", None)
    if isinstance(inner, torch.nn.Module) and isinstance(getattr(inner, "language_model", None), torch.nn.Module):
        return inner
    return base.get_decoder()


def _router_balance(model: torch.nn.Module) -> tuple[Callable, int, int] | None:
    """The architecture's own (load_balancing_loss_func, num_experts, top_k), or None if it has none.

    Every Transformers MoE causal LM that trains with an aux loss defines that function in its
    modelling module and keeps `num_experts`/`num_experts_per_tok` on the model for it; DeepSeek-V3
    balances experts with a routing bias instead and defines none.
    """
    if not hasattr(model.config, "output_router_logits"):
        return None
    func = getattr(inspect.getmodule(type(model)), "load_balancing_loss_func", None)
    num_experts, top_k = getattr(model, "num_experts", None), getattr(model, "num_experts_per_tok", None)
    if func is None or not num_experts or not top_k:
        return None
    return func, num_experts, top_k


def resolve_router_aux_loss_coef(model: torch.nn.Module, requested: float | None = None) -> float:
    """The aux-loss coefficient to train with: `requested`, else the model config's; 0.0 means none."""
    base = unwrap(model)
    has_router_loss = _router_balance(base) is not None
    if requested is None:
        return float(getattr(base.config, "router_aux_loss_coef", 0.0) or 0.0) if has_router_loss else 0.0
    if requested < 0:
        raise ValueError(f"router_aux_loss_coef={requested!r} must be >= 0 (0 disables the router aux loss).")
    if requested > 0 and not has_router_loss:
        raise ValueError(
            f"router_aux_loss_coef={requested!r}: model_type {base.config.model_type!r} has no router "
            "load-balancing loss in Transformers (dense, or balanced by a routing bias like DeepSeek-V3); "
            "pass None or 0."
        )
    return float(requested)


MODEL_INPUT_KEYS = ("input_ids", "attention_mask", "position_ids",
                    "cu_seq_lens_q", "prefix_spans")  # the last two: a padding-free batch's layout (twinkle_sdpa)


def model_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What of `batch` the model's forward takes (its token ids, mask, positions and padding-free layout)."""
    return {key: batch[key] for key in MODEL_INPUT_KEYS if key in batch}


def sequence_count(batch: dict[str, torch.Tensor]) -> int:
    """The sequences in a batch: its rows, or the samples of a padding-free row."""
    return len(batch["cu_seq_lens_q"]) - 1 if "cu_seq_lens_q" in batch else batch["input_ids"].shape[0]


def target_owners(batch: dict[str, torch.Tensor], selected: torch.Tensor) -> torch.Tensor:
    """The sequence of each selected target: its row in a padded batch, its sample in a padding-free one (a target
    belongs to the sample its token lies in). `selected`: the targets' mask over labels[:, 1:]."""
    if "cu_seq_lens_q" not in batch:
        return selected.nonzero()[:, 0]
    bounds = batch["cu_seq_lens_q"].to(selected.device).long()
    tokens = torch.arange(1, selected.shape[1] + 1, device=selected.device)
    return (torch.searchsorted(bounds, tokens, right=True) - 1)[selected[0]]


def trained_positions(labels: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The positions that predict a target, as flat indices over labels' [rows, length] on `device`: found on the
    host from the collated labels, they select on the device without waiting for it (a boolean mask would)."""
    rows, cols = (labels[:, 1:] != IGNORE_INDEX).nonzero(as_tuple=True)
    flat = rows * labels.shape[1] + cols
    return to_device_async(flat, device)


def at_trained(x: torch.Tensor, selected: torch.Tensor, positions: slice = slice(None, -1)) -> torch.Tensor:
    """x[:, positions][selected]; `selected` is that boolean mask or flat indices over x's first two dimensions
    (trained_positions)."""
    if selected.dtype == torch.bool:
        return x[:, positions][selected]
    return x.flatten(0, 1).index_select(0, selected)


def trained_logits(model: torch.nn.Module, inputs: dict[str, torch.Tensor], selected: torch.Tensor,
                   extra: dict | None = None, positions: slice = slice(None, -1)) -> tuple[torch.Tensor, Any]:
    """Logits at the `selected` (trained) positions, in row-major order, and the model's outputs.

    `positions` are the positions that predict a target (all but the last, or all of a pre-shifted slice).

    One pass over the whole batch; the output layer runs only where a label exists when the head allows it.
    """
    hidden, head, outputs = trained_hidden(model, inputs, selected, extra, positions)
    return (at_trained(outputs.logits, selected, positions) if head is None else head(hidden)), outputs


def trained_hidden(model: torch.nn.Module, inputs: dict[str, torch.Tensor], selected: torch.Tensor,
                   extra: dict | None = None, positions: slice = slice(None, -1)) -> tuple[torch.Tensor | None,
                                                                                          torch.nn.Module | None, Any]:
    """(last hidden states at the `selected` positions, the output layer, the model's outputs) when the logits are
    exactly output_layer(hidden); else (None, None, outputs) with the full logits in `outputs.logits`. `selected`:
    a boolean mask over the `positions`, or trained_positions' flat indices."""
    base = unwrap(model)
    with padding_free_forward(inputs):
        if has_plain_head(base):
            outputs = backbone(base)(**inputs, use_cache=False, **(extra or {}))
            return at_trained(outputs.last_hidden_state, selected, positions), base.get_output_embeddings(), outputs
        return None, None, model(**inputs, use_cache=False, **(extra or {}))


def causal_lm_loss_sum(
    model: torch.nn.Module, batch: dict[str, torch.Tensor], router_aux_loss_coef: float | None = None, group=None
) -> LossParts:
    """Sum of next-token cross-entropy over trained tokens (+ coef * router aux loss * tokens for MoE).

    The targets are `labels` shifted here, or `shift_labels`: already shifted, one per position (a sequence
    parallel slice, whose last target is the first token of the next slice).
    `router_aux_loss_coef`: None uses the model config's coefficient; 0 skips the router aux loss.
    `group`: the data-parallel ranks sharing the global micro-batch (None: this process has all of it).
    """
    shifted = "shift_labels" in batch
    inputs = {k: v for k, v in batch.items() if k not in ("labels", "shift_labels")}
    targets = batch["shift_labels"] if shifted else batch["labels"][:, 1:]
    positions = slice(None) if shifted else slice(None, -1)  # the positions that predict a target
    host = None if shifted else host_of(batch)
    if host is not None:  # positions and count from the collated labels: nothing waits for the device
        selected = trained_positions(host["labels"], targets.device)
        num_tokens, targets = selected.numel(), batch["labels"].flatten()
        target_ids = targets.index_select(0, selected + 1)  # the next token of the row
    else:
        selected = targets != IGNORE_INDEX
        num_tokens, target_ids = int(selected.sum()), targets[selected]
    base = unwrap(model)
    coef = resolve_router_aux_loss_coef(base, router_aux_loss_coef)
    balance = _router_balance(base) if coef else None
    extra = {"output_router_logits": True} if balance else {}
    hidden, head, outputs = trained_hidden(model, inputs, selected, extra, positions)
    if head is not None and fusable_head(head) and not head.weight.requires_grad:  # a frozen head (LoRA): chunked,
        # no [tokens, vocab] fp32 logits (linear_ce.py); a trained head keeps autograd's path, which every parallel
        # strategy's gradient reduction of the output weight was proven with
        loss_sum = linear_cross_entropy_sum(hidden, head.weight, target_ids)
    else:
        logits = at_trained(outputs.logits, selected, positions) if head is None else head(hidden)
        loss_sum = F.cross_entropy(logits.float(), target_ids, reduction="sum")
    if balance is None:
        return LossParts(loss_sum, num_tokens)
    func, num_experts, top_k = balance
    mask = inputs.get("attention_mask")
    # Packed batches carry a 4-D block mask that the balance function cannot read: count every row then.
    mask = mask if mask is not None and mask.dim() == 2 else None
    if group is not None:
        share, aux, global_tokens = global_aux_loss_share(outputs.router_logits, num_experts, top_k, mask, num_tokens,
                                                          group)
        return LossParts(loss_sum + coef * share.to(loss_sum.dtype) * global_tokens, num_tokens, aux)
    aux = func(outputs.router_logits, num_experts, top_k, mask)
    aux = aux.to(loss_sum.device, loss_sum.dtype)
    return LossParts(loss_sum + coef * aux * num_tokens, num_tokens, aux.detach())
