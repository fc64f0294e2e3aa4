"""GRPO's arithmetic: group-normalised advantages, the PPO-clipped surrogate with a k3 KL term, and the
per-`loss_type` reduction, as sums and counts so that the stepper's division by the step's global count
makes gradient accumulation and data parallelism equal one process.

Conventions (checked against trl 1.16's GRPOTrainer on the same inputs, tests/rl):
- advantages: (r - group mean) / (group std + eps), std with Bessel's correction, eps 1e-4; with
  `scale_rewards=False`, r - group mean (Dr. GRPO);
- ratio = exp(logp - logp_old) per token, clipped to [1 - epsilon, 1 + epsilon_high] (DAPO's asymmetric
  clip when epsilon_high > epsilon); token loss = -min(ratio * A, clipped * A) + beta * k3, where
  k3 = exp(ref - logp) - (ref - logp) - 1 (DeepSeekMath's estimator; `kl_correction` weighs it by the
  ratio, as trl 1.16 does by default with use_bias_correction_kl);
- loss_type `grpo`: each sequence's token mean, averaged over sequences; `dapo`: the mean over every
  completion token of the step; `dr_grpo`: the token sum divided by (sequences x max_completion_length).

Tokens are flat here: `logps` etc. hold one value per completion token, `rows` the sequence each belongs to.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

LOSS_TYPES = ("grpo", "dapo", "dr_grpo")
ADVANTAGE_EPS = 1e-4


def group_advantages(rewards: torch.Tensor, num_generations: int, scale_rewards: bool = True,
                     eps: float = ADVANTAGE_EPS) -> torch.Tensor:
    """Advantages of `rewards` laid out group after group (`num_generations` completions of one prompt)."""
    if rewards.numel() % num_generations:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of num_generations={num_generations}")
    grouped = rewards.float().view(-1, num_generations)
    advantages = grouped - grouped.mean(dim=1, keepdim=True)
    if scale_rewards:
        std = grouped.std(dim=1, keepdim=True) if num_generations > 1 else torch.zeros_like(grouped[:, :1])
        advantages = advantages / (std + eps)
    return advantages.reshape(-1)


@dataclass
class TokenTerms:
    loss: torch.Tensor  # per token
    kl: torch.Tensor | None  # per token, k3; None when beta is 0
    clipped: torch.Tensor  # per token, 1.0 where the clip took effect


def token_terms(logps: torch.Tensor, old_logps: torch.Tensor, advantages: torch.Tensor,
                ref_logps: torch.Tensor | None = None, *, epsilon: float = 0.2, epsilon_high: float | None = None,
                beta: float = 0.0, kl_correction: bool = False) -> TokenTerms:
    """The clipped surrogate (plus beta * k3) of every token; `advantages` per token (its sequence's).
    `kl_correction` weighs k3 by the importance ratio (the completions were sampled from the old policy;
    trl's use_bias_correction_kl)."""
    high = epsilon if epsilon_high is None else epsilon_high
    ratio = torch.exp(logps - old_logps)
    clipped_ratio = torch.clamp(ratio, 1 - epsilon, 1 + high)
    loss = -torch.min(ratio * advantages, clipped_ratio * advantages)
    clipped = (((ratio < 1 - epsilon) & (advantages < 0)) | ((ratio > 1 + high) & (advantages > 0))).float()
    kl = None
    if beta:
        if ref_logps is None:
            raise ValueError("beta > 0 needs the reference log-probs")
        delta = ref_logps - logps
        kl = torch.exp(delta) - delta - 1
        if kl_correction:
            kl = kl * ratio
        loss = loss + beta * kl
    return TokenTerms(loss, kl, clipped)


def reduce_tokens(values: torch.Tensor, rows: torch.Tensor, sequences: int, loss_type: str,
                  max_completion_length: int | None = None) -> tuple[torch.Tensor, int]:
    """(sum, count) whose ratio is the `loss_type`'s loss, summed so that partial sums over micro-batches or
    ranks add up: per-sequence means and their number (grpo), token sums and token count (dapo), or token
    sums over max_completion_length and the number of sequences (dr_grpo)."""
    if loss_type == "dapo":
        return values.sum(), int(values.numel())
    if loss_type == "dr_grpo":
        if not max_completion_length:
            raise ValueError("loss_type='dr_grpo' needs max_completion_length")
        return values.sum() / max_completion_length, sequences
    if loss_type != "grpo":
        raise ValueError(f"loss_type={loss_type!r}: choose one of {', '.join(LOSS_TYPES)}")
    per_row = torch.zeros(sequences, dtype=values.dtype, device=values.device).index_add(0, rows, values)
    tokens = torch.bincount(rows, minlength=sequences).clamp(min=1).to(values.dtype)
    return (per_row / tokens).sum(), sequences
