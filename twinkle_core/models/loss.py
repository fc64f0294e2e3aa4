"""Causal-LM loss summed over trained tokens, computing logits only where a label exists.

In SFT most positions are prompt tokens (label -100). Running the output layer and the log-softmax
over the whole vocabulary only at the trained positions skips that work and the fp32 logits it
would materialise; the result is the same sum as cross-entropy over all positions.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model under a PEFT wrapper (LoRA layers stay injected)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def _has_plain_head(model: torch.nn.Module) -> bool:
    """True when logits are exactly output_layer(last_hidden_state) (no soft-capping or scaling)."""
    config = model.config
    if getattr(config, "final_logit_softcapping", None) or getattr(config, "logit_scale", None):
        return False
    try:
        return model.get_decoder() is not None and model.get_output_embeddings() is not None
    except (AttributeError, NotImplementedError):
        return False


def causal_lm_loss_sum(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
    """Return (sum of next-token cross-entropy over trained tokens, number of trained tokens)."""
    labels = batch["labels"]
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    targets = labels[:, 1:]
    selected = targets != IGNORE_INDEX
    num_tokens = int(selected.sum())
    base = _unwrap(model)
    if _has_plain_head(base):
        hidden = base.get_decoder()(**inputs, use_cache=False).last_hidden_state
        hidden = hidden[:, :-1][selected]
        logits = base.get_output_embeddings()(hidden)
    else:
        logits = model(**inputs, use_cache=False).logits[:, :-1][selected]
    loss_sum = F.cross_entropy(logits.float(), targets[selected], reduction="sum")
    return loss_sum, num_tokens
