"""Preference objectives on chosen/rejected pairs: DPO (`sigmoid`), `ipo`, and the reference-free `simpo`
and `orpo`, chosen by `loss_type`.

A batch holds the n chosen sequences, then the n rejected ones (twinkle_core.data.preference): one forward
scores both. Padding-free (the default where the model attends through twinkle_sdpa), the row holds each pair's
prompt once: the rejected reply attends to the prompt in its chosen sequence. A sequence's log-prob is the sum
over its reply tokens, with the output layer run only at those tokens. Losses are summed over pairs and counted
in pairs, so the stepper's division by the step's global pair count makes gradient accumulation and every
data-parallel strategy equal one process.

The reference (sigmoid, ipo): the precomputed log-probs in the batch when the run has them
(`precompute_reference`); else, with LoRA, the same model with its adapter disabled (no second copy);
else, for full training, a frozen copy made when the optimizer is set. Dropout is disabled, as in trl, so
that policy and reference score the same function.

Conventions, checked against trl 1.16 on the same batch (tests/preference): sigmoid and ipo as trl's
DPOTrainer (ipo on per-token mean log-ratios), simpo as trl's CPOTrainer with cpo_alpha=0 (log-probs and
rewards are per-token means, reward = beta * mean log-prob). `label_smoothing` gives the conservative
DPO loss (trl 1.16's sigmoid has none). rpo_alpha and orpo's SFT term are the chosen reply's per-token
mean NLL of each pair, averaged over pairs (trl averages over the batch's tokens); orpo's `beta` is its
lambda, as in trl's ORPOTrainer.
"""
from __future__ import annotations

import copy
from pathlib import Path

import torch
import torch.nn.functional as F

from twinkle_core.data.encode import IGNORE_INDEX
from twinkle_core.data.preference import REFERENCE_KEYS
from twinkle_core.objectives import Objective, register_objective
from twinkle_core.objectives.causal_lm import (LossParts, model_inputs, sequence_count, target_owners,
                                              trained_logits)

LOSS_TYPES = ("sigmoid", "ipo", "simpo", "orpo")
REFERENCE_FREE = frozenset({"simpo", "orpo"})
MEAN_LOGPS = frozenset({"ipo", "simpo", "orpo"})  # scored on per-token mean log-probs
DEFAULTS = {"loss_type": "sigmoid", "beta": 0.1, "label_smoothing": 0.0, "simpo_gamma": 0.5, "rpo_alpha": 0.0,
            "precompute_reference": False}
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margin", "rewards/accuracy", "logps/chosen",
           "logps/rejected")
_REFERENCE_ATTR = "_twinkle_reference_model"  # a frozen copy, kept off the module tree (no wrapper sees it)


def _options(model_dir: Path, family, options: dict) -> dict:
    resolved = {**DEFAULTS, **{key: value for key, value in options.items() if value is not None}}
    if resolved["loss_type"] not in LOSS_TYPES:
        raise ValueError(f"loss_type={resolved['loss_type']!r}: choose one of {', '.join(LOSS_TYPES)}")
    for key in ("beta", "label_smoothing", "simpo_gamma", "rpo_alpha"):
        resolved[key] = float(resolved[key])
    if resolved["beta"] <= 0:
        raise ValueError(f"beta={resolved['beta']!r} must be > 0")
    if not 0 <= resolved["label_smoothing"] < 0.5:
        raise ValueError(f"label_smoothing={resolved['label_smoothing']!r} must be in [0, 0.5)")
    if resolved["rpo_alpha"] < 0:
        raise ValueError(f"rpo_alpha={resolved['rpo_alpha']!r} must be >= 0 (0: no SFT term)")
    resolved["precompute_reference"] = bool(resolved["precompute_reference"])
    if resolved["precompute_reference"] and resolved["loss_type"] in REFERENCE_FREE:
        raise ValueError(f"precompute_reference: loss_type={resolved['loss_type']!r} uses no reference model")
    return resolved


def disable_dropout(model: torch.nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    for key in ("attention_dropout", "hidden_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop"):
        if isinstance(getattr(model.config, key, None), float):
            setattr(model.config, key, 0.0)


def _is_adapter_model(model: torch.nn.Module) -> bool:
    from peft import PeftModel

    return isinstance(model, PeftModel)


def _attach_reference(model: torch.nn.Module, options: dict) -> None:
    """Full training against a reference: a frozen copy of the model as it is before the first step."""
    if options["loss_type"] in REFERENCE_FREE or options["precompute_reference"] or _is_adapter_model(model):
        return
    reference = copy.deepcopy(model).requires_grad_(False).eval()
    object.__setattr__(model, _REFERENCE_ATTR, reference)


def sequence_logps(model: torch.nn.Module, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's summed log-prob of its labelled tokens, and their number: per row of a padded batch, per
    sample of a padding-free one (collate_preferences_padding_free)."""
    inputs = model_inputs(batch)
    targets = batch["labels"][:, 1:]
    selected = targets != IGNORE_INDEX
    logits, _ = trained_logits(model, inputs, selected)
    token_logps = -F.cross_entropy(logits.float(), targets[selected], reduction="none")
    sequences, owners = sequence_count(batch), target_owners(batch, selected)
    logps = torch.zeros(sequences, dtype=token_logps.dtype, device=token_logps.device)
    return logps.index_add(0, owners, token_logps), torch.bincount(owners, minlength=sequences)


def reference_logps(model: torch.nn.Module, batch: dict, precompute_reference: bool = False) -> torch.Tensor:
    """The reference's summed log-probs of the batch's rows (chosen, then rejected)."""
    if all(key in batch for key in REFERENCE_KEYS):
        return torch.cat([batch[key] for key in REFERENCE_KEYS]).to(torch.float32)
    if precompute_reference:
        raise ValueError(f"precompute_reference=True, but the batch has no {' / '.join(REFERENCE_KEYS)}; "
                         "tokenize with the reference task first (flows.dpo does)")
    reference = getattr(model, _REFERENCE_ATTR, None)
    with torch.no_grad():
        if reference is not None:
            return sequence_logps(reference, batch)[0]
        if not _is_adapter_model(model):
            raise RuntimeError("the preference loss needs a reference: train a LoRA adapter (the base is the "
                               "reference), set the optimizer first (full training copies the model), or "
                               "precompute the reference log-probs")
        with model.disable_adapter():
            return sequence_logps(model, batch)[0]


def pair_losses(chosen: torch.Tensor, rejected: torch.Tensor, chosen_tokens: torch.Tensor,
                rejected_tokens: torch.Tensor, ref_chosen: torch.Tensor | None, ref_rejected: torch.Tensor | None,
                *, loss_type: str = "sigmoid", beta: float = 0.1, label_smoothing: float = 0.0,
                simpo_gamma: float = 0.5, rpo_alpha: float = 0.0, **_) -> tuple[torch.Tensor, dict]:
    """Per-pair losses from summed log-probs, and the per-pair metric values (rewards, log-probs)."""
    chosen_mean = chosen / chosen_tokens.clamp(min=1)
    rejected_mean = rejected / rejected_tokens.clamp(min=1)
    nll = -chosen_mean  # the chosen reply's per-token NLL (rpo_alpha, orpo)
    if loss_type in ("sigmoid", "ipo"):
        chosen_ratio, rejected_ratio = chosen - ref_chosen, rejected - ref_rejected
        chosen_reward, rejected_reward = beta * chosen_ratio.detach(), beta * rejected_ratio.detach()
        if loss_type == "sigmoid":
            h = beta * (chosen_ratio - rejected_ratio)
            losses = -(1 - label_smoothing) * F.logsigmoid(h) - label_smoothing * F.logsigmoid(-h)
        else:
            delta = chosen_ratio / chosen_tokens.clamp(min=1) - rejected_ratio / rejected_tokens.clamp(min=1)
            losses = (delta - 1 / (2 * beta)) ** 2
        logged = (chosen, rejected)
    elif loss_type == "simpo":
        h = beta * (chosen_mean - rejected_mean) - simpo_gamma
        losses = -(1 - label_smoothing) * F.logsigmoid(h) - label_smoothing * F.logsigmoid(-h)
        chosen_reward, rejected_reward = beta * chosen_mean.detach(), beta * rejected_mean.detach()
        logged = (chosen_mean, rejected_mean)
    else:  # orpo: SFT on chosen plus lambda * the log-odds-ratio term (log-probs are per-token means, < 0)
        log_odds = (chosen_mean - rejected_mean) - (torch.log1p(-torch.exp(chosen_mean))
                                                    - torch.log1p(-torch.exp(rejected_mean)))
        losses = nll - beta * F.logsigmoid(log_odds)
        chosen_reward, rejected_reward = beta * chosen_mean.detach(), beta * rejected_mean.detach()
        logged = (chosen_mean, rejected_mean)
    if rpo_alpha and loss_type != "orpo":
        losses = losses + rpo_alpha * nll
    values = {"rewards/chosen": chosen_reward, "rewards/rejected": rejected_reward,
              "rewards/margin": chosen_reward - rejected_reward,
              "rewards/accuracy": (chosen_reward > rejected_reward).float(),
              "logps/chosen": logged[0].detach(), "logps/rejected": logged[1].detach()}
    return losses, values


def preference_loss_sum(model: torch.nn.Module, batch: dict, router_aux_loss_coef=None, group=None,
                        **options) -> LossParts:
    """The loss summed over this rank's pairs, their number, and the metrics summed over them."""
    pairs = sequence_count(batch) // 2
    loss_type = options.get("loss_type", "sigmoid")
    reference = None
    if loss_type not in REFERENCE_FREE:  # first, so only the policy's forward keeps activations
        reference = reference_logps(model, batch, options.get("precompute_reference", False))
    logps, tokens = sequence_logps(model, batch)
    ref_chosen, ref_rejected = (None, None) if reference is None else (reference[:pairs], reference[pairs:])
    losses, values = pair_losses(logps[:pairs], logps[pairs:], tokens[:pairs], tokens[pairs:], ref_chosen,
                                 ref_rejected, **options)
    valid = batch.get("pair_valid")
    valid = torch.ones(pairs, dtype=torch.bool, device=losses.device) if valid is None else valid.bool()
    weight = valid.to(losses.dtype)  # a stand-in pair keeps its graph (every rank runs backward) at weight 0
    metrics = {name: float((values[name] * weight).sum()) for name in METRICS}
    return LossParts((losses * weight).sum(), int(valid.sum()), metrics=metrics)


register_objective(Objective(
    "preference", "preference", preference_loss_sum, frozenset({"transformers"}), splits=frozenset({"dp", "fsdp"}),
    resolve_options=_options, prepare_model=disable_dropout, prepare_training=_attach_reference,
    option_names=tuple(DEFAULTS)))
