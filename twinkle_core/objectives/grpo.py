"""The GRPO objective on a batch of sampled completions (twinkle_core.rl.grpo holds the arithmetic).

A batch holds each completion after its prompt: `input_ids`, `attention_mask`, `labels` (the completion's
token ids, IGNORE_INDEX elsewhere: exactly the sampled tokens are scored), `advantages` (one per completion),
either as padded rows or padding-free (twinkle_core.rl.sampler.completion_batch_padding_free: a group's prompt
held once, its other completions attending to it),
and, aligned with `labels` (the value at a labelled position is that token's log-prob), `old_logps` (the
policy's log-probs when sampled; absent: the current ones, detached, as on the first of `num_iterations`
passes) and `ref_logps` (the reference's, when beta > 0; absent: computed here, with LoRA as the base
under a disabled adapter). `row_valid` marks a rank's stand-in rows (weight 0).
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from twinkle_core.data.encode import IGNORE_INDEX
from twinkle_core.objectives import Objective, register_objective
from twinkle_core.objectives.causal_lm import (LossParts, model_inputs, sequence_count, target_owners,
                                              trained_logits)
from twinkle_core.objectives.preference import disable_dropout
from twinkle_core.rl.grpo import LOSS_TYPES, reduce_tokens, token_terms

DEFAULTS = {"loss_type": "grpo", "epsilon": 0.2, "epsilon_high": None, "beta": 0.0, "kl_correction": False,
            "max_completion_length": None}
# What the recipe's rollouts take (twinkle_core.train.grpo); the loss ignores them.
ROLLOUT_DEFAULTS = {"num_generations": 4, "num_iterations": 1, "max_new_tokens": 64, "temperature": 1.0,
                    "top_p": 1.0, "scale_rewards": True, "rewards": ["numeric_match"], "reward_weights": None,
                    "reward_options": {}}


def rollout_options(options: dict) -> dict:
    """The rollout settings of `options`, defaults filled in."""
    return {key: default if options.get(key) is None else options[key] for key, default in ROLLOUT_DEFAULTS.items()}


def resolve_options(model_dir: Path | None, family, options: dict) -> dict:
    rollout = rollout_options(options)
    if int(rollout["num_generations"]) < 2:
        raise ValueError(f"num_generations={rollout['num_generations']!r}: a group needs >= 2 completions")
    if int(rollout["num_iterations"]) < 1:
        raise ValueError(f"num_iterations={rollout['num_iterations']!r} must be >= 1")
    resolved = {**DEFAULTS, **rollout, **{key: value for key, value in options.items() if value is not None}}
    if resolved["loss_type"] not in LOSS_TYPES:
        raise ValueError(f"loss_type={resolved['loss_type']!r}: choose one of {', '.join(LOSS_TYPES)}")
    if not 0 < float(resolved["epsilon"]) < 1:
        raise ValueError(f"epsilon={resolved['epsilon']!r} must be in (0, 1)")
    if resolved["epsilon_high"] is not None and float(resolved["epsilon_high"]) < float(resolved["epsilon"]):
        raise ValueError(f"epsilon_high={resolved['epsilon_high']!r} must be >= epsilon={resolved['epsilon']!r}")
    if float(resolved["beta"]) < 0:
        raise ValueError(f"beta={resolved['beta']!r} must be >= 0 (0: no KL term)")
    if resolved["loss_type"] == "dr_grpo" and not resolved["max_completion_length"]:
        resolved["max_completion_length"] = int(resolved["max_new_tokens"])  # the most a completion can hold
    return resolved


def completion_logps(model: torch.nn.Module, batch: dict, with_entropy: bool = False):
    """Per completion token: its log-prob, its sequence (row, or sample of a padding-free batch), and
    (optionally) the policy's entropy there."""
    inputs = model_inputs(batch)
    targets = batch["labels"][:, 1:]
    selected = targets != IGNORE_INDEX
    logits, _ = trained_logits(model, inputs, selected)
    log_probs = F.log_softmax(logits.float(), dim=-1)
    logps = log_probs.gather(1, targets[selected].unsqueeze(1)).squeeze(1)
    entropy = -(log_probs.exp() * log_probs).sum(-1).detach() if with_entropy else None
    return logps, target_owners(batch, selected), selected, entropy


def _aligned(batch: dict, key: str, selected: torch.Tensor) -> torch.Tensor | None:
    """A per-position tensor (aligned with labels) at the completion tokens, in the same order as the logps."""
    return batch[key][:, 1:][selected].float() if key in batch else None


def reference_token_logps(model: torch.nn.Module, batch: dict, selected: torch.Tensor) -> torch.Tensor:
    from peft import PeftModel

    if not isinstance(model, PeftModel):
        raise RuntimeError("beta > 0 needs reference log-probs: train a LoRA adapter (the base is the reference) "
                           "or pass ref_logps in the batch")
    with torch.no_grad(), model.disable_adapter():
        return completion_logps(model, batch)[0]


def grpo_loss_sum(model: torch.nn.Module, batch: dict, router_aux_loss_coef=None, group=None, **options) -> LossParts:
    options = {**DEFAULTS, **options}
    logps, rows, selected, entropy = completion_logps(model, batch, with_entropy=True)
    sequences = sequence_count(batch)
    old = _aligned(batch, "old_logps", selected)
    old = logps.detach() if old is None else old
    ref = None
    if options["beta"]:
        ref = _aligned(batch, "ref_logps", selected)
        ref = reference_token_logps(model, batch, selected) if ref is None else ref
    valid = batch.get("row_valid")
    weight = torch.ones(sequences, device=logps.device) if valid is None else valid.to(logps.device).float()
    advantages = batch["advantages"].to(logps.device).float()[rows]
    terms = token_terms(logps, old, advantages, ref, epsilon=options["epsilon"], epsilon_high=options["epsilon_high"],
                        beta=options["beta"], kl_correction=options["kl_correction"])
    token_weight = weight[rows]
    loss_sum, count = reduce_tokens(terms.loss * token_weight, rows, sequences, options["loss_type"],
                                    options["max_completion_length"])
    if valid is not None:  # stand-in rows count for nothing
        count = int(token_weight.sum()) if options["loss_type"] == "dapo" else int(weight.sum())
    # Metrics reduce as the loss does: token means (dapo) or per-sequence means; the rollout logs the rest.
    reduce_as = "dapo" if options["loss_type"] == "dapo" else "grpo"
    metrics = {name: float(reduce_tokens(values.detach() * token_weight, rows, sequences, reduce_as)[0])
               for name, values in (("kl", terms.kl), ("clip_fraction", terms.clipped), ("entropy", entropy))
               if values is not None}
    return LossParts(loss_sum, count, metrics=metrics)


register_objective(Objective(
    "grpo", "prompts", grpo_loss_sum, frozenset({"transformers"}), splits=frozenset({"dp", "fsdp"}),
    resolve_options=resolve_options, prepare_model=disable_dropout,
    option_names=tuple(DEFAULTS) + tuple(ROLLOUT_DEFAULTS)))
