"""Learning-rate schedules by name (the `scheduler_cls` of `set_lr_scheduler`)."""
from __future__ import annotations

import math
from typing import Callable

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

_SCHEDULES: dict[str, Callable[[int, int, int], float]] = {}


def register_schedule(name: str):
    """Register a schedule `factor(step, num_warmup_steps, num_training_steps) -> lr multiplier`."""

    def add(fn):
        if name in _SCHEDULES:
            raise ValueError(f"schedule {name!r} is already registered")
        _SCHEDULES[name] = fn
        return fn

    return add


def _warmup(step: int, warmup: int) -> float | None:
    return (step + 1) / warmup if step < warmup else None


@register_schedule("CosineWarmupScheduler")
def _cosine(step: int, warmup: int, total: int) -> float:
    ramp = _warmup(step, warmup)
    if ramp is not None:
        return ramp
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return 0.5 * (1.0 + math.cos(math.pi * progress))


@register_schedule("LinearWarmupScheduler")
def _linear(step: int, warmup: int, total: int) -> float:
    ramp = _warmup(step, warmup)
    if ramp is not None:
        return ramp
    return max(0.0, 1.0 - (step - warmup) / max(1, total - warmup))


@register_schedule("ConstantWarmupScheduler")
def _constant(step: int, warmup: int, total: int) -> float:
    ramp = _warmup(step, warmup)
    return 1.0 if ramp is None else ramp


def lr_factor(name: str, step: int, num_warmup_steps: int, num_training_steps: int) -> float:
    """The multiplier of the base learning rate at `step` (for optimizers that are not torch ones)."""
    _check(name, num_warmup_steps, num_training_steps)
    return _SCHEDULES[name](step, num_warmup_steps, num_training_steps)


def build_scheduler(optimizer: Optimizer, name: str, num_warmup_steps: int, num_training_steps: int) -> LambdaLR:
    _check(name, num_warmup_steps, num_training_steps)
    schedule = _SCHEDULES[name]
    return LambdaLR(optimizer, lambda step: schedule(step, num_warmup_steps, num_training_steps))


def _check(name: str, num_warmup_steps: int, num_training_steps: int) -> None:
    if name not in _SCHEDULES:
        raise ValueError(f"scheduler_cls={name!r} is unknown; choose one of {sorted(_SCHEDULES)}.")
    if num_warmup_steps < 0 or num_training_steps < 1:
        raise ValueError(
            f"num_warmup_steps={num_warmup_steps}, num_training_steps={num_training_steps}: "
            "warm-up must be >= 0 and training steps >= 1."
        )
