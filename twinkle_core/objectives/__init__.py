"""Training objectives: the loss that `forward_backward` computes, and the rows it trains on.

An objective names its row kind (twinkle_core.data.formats: how a row is validated and encoded) and the
backends that implement it. On the Transformers backend its `loss_sum(model, batch, router_aux_loss_coef,
group)` returns a LossParts: the loss summed over the micro-batch's trained units and their count, which
the stepper divides by the step's global count (so every strategy matches one process). Megatron-Core
computes the causal-LM loss in its own pipeline schedule (twinkle_core.megatron.step).

A new kind of training adds one module here that registers its objective, a row kind in
twinkle_core.data.formats, and a flow file; nothing else is copied (docs/ARCHITECTURE.md).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from twinkle_core.config.registry import Registry
from twinkle_core.objectives.causal_lm import LossParts, causal_lm_loss_sum


@dataclass(frozen=True)
class Objective:
    name: str
    row_kind: str  # the data rows it trains on (a registered row kind)
    loss_sum: Callable[..., LossParts]  # (model, batch, router_aux_loss_coef, group) -> LossParts
    backends: frozenset[str]  # the training backends that implement it


_OBJECTIVES: Registry[Objective] = Registry("objective", "training objective")


def register_objective(objective: Objective) -> Objective:
    """Add an objective; a name can be registered only once."""
    return _OBJECTIVES.register(objective.name, objective)


def get_objective(name: str) -> Objective:
    return _OBJECTIVES.get(name)


register_objective(Objective("causal_lm", "chat", causal_lm_loss_sum, frozenset({"transformers", "megatron"})))

__all__ = ["LossParts", "Objective", "get_objective", "register_objective"]
