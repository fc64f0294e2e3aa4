"""Tinker's built-in losses over one row's target log-probabilities, summed as Tinker defines them.

Every loss input is aligned with the row: position i of the input predicts `target_tokens[i]`.
- cross_entropy: -sum(weights * logprobs); targets (N,) or (N, K) with weights of the same shape
  (top-K distillation);
- importance_sampling: -sum(exp(logprobs - sampling_logprobs) * advantages);
- ppo: -sum(min(ratio * A, clip(ratio, clip_low_threshold, clip_high_threshold) * A)), thresholds from
  the request's loss_fn_config (0.8 and 1.2 when not given).
Each returns the row's loss as a tensor (for backward) and its per-datum outputs (`logprobs`).
"""
from __future__ import annotations

import numpy as np
import torch

from twinkle_core.errors import UserError

REQUIRED = {
    "cross_entropy": ("target_tokens", "weights"),
    "importance_sampling": ("target_tokens", "logprobs", "advantages"),
    "ppo": ("target_tokens", "logprobs", "advantages"),
}
CONFIG_KEYS = {"cross_entropy": (), "importance_sampling": (), "ppo": ("clip_low_threshold", "clip_high_threshold")}


def check_inputs(loss_fn: str, config: dict, inputs: dict[str, np.ndarray], length: int, where: str) -> None:
    """Raise a UserError naming the datum and the input unless `inputs` fit `loss_fn` and a row of `length`."""
    if loss_fn not in REQUIRED:
        raise UserError(f"loss_fn={loss_fn!r} is not supported by this server; use one of {sorted(REQUIRED)} "
                        "(forward_backward_custom runs on the client and needs only these)")
    unknown = set(config) - set(CONFIG_KEYS[loss_fn])
    if unknown:
        raise UserError(f"loss_fn_config keys {sorted(unknown)} are not used by {loss_fn!r} "
                        f"(it reads {list(CONFIG_KEYS[loss_fn]) or 'none'})")
    for name in REQUIRED[loss_fn]:
        if name not in inputs:
            raise UserError(f"{where}: loss_fn {loss_fn!r} needs loss_fn_inputs {list(REQUIRED[loss_fn])}; "
                            f"{name!r} is missing (got {sorted(inputs)})")
    targets = inputs["target_tokens"]
    ranks = (1, 2) if loss_fn == "cross_entropy" else (1,)
    if targets.ndim not in ranks or targets.shape[0] != length:
        raise UserError(f"{where}: target_tokens has shape {list(targets.shape)}, the input has {length} tokens; "
                        f"expected [{length}]" + (f" or [{length}, K]" if loss_fn == "cross_entropy" else ""))
    for name in REQUIRED[loss_fn][1:]:
        if inputs[name].shape != targets.shape:
            raise UserError(f"{where}: {name} has shape {list(inputs[name].shape)}, target_tokens "
                            f"{list(targets.shape)}; they must match")
        if not np.isfinite(inputs[name]).all():
            raise UserError(f"{where}: {name} holds NaN or infinite values")


def loss_sum(loss_fn: str, config: dict, logprobs: torch.Tensor, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """The row's summed loss from its target log-probabilities (shaped like target_tokens)."""
    if loss_fn == "cross_entropy":
        return -(inputs["weights"] * logprobs).sum()
    ratio = torch.exp(logprobs - inputs["logprobs"])
    advantages = inputs["advantages"]
    if loss_fn == "importance_sampling":
        return -(ratio * advantages).sum()
    low, high = float(config.get("clip_low_threshold", 0.8)), float(config.get("clip_high_threshold", 1.2))
    clipped = torch.clamp(ratio, low, high)
    return -torch.minimum(ratio * advantages, clipped * advantages).sum()
