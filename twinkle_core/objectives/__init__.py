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

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from twinkle_core.config.registry import Registry
from twinkle_core.objectives.causal_lm import LossParts, causal_lm_loss_sum


@dataclass(frozen=True)
class Objective:
    name: str
    row_kind: str  # the data rows it trains on (a registered row kind)
    loss_sum: Callable[..., LossParts]  # (model, batch, router_aux_loss_coef, group) -> LossParts
    backends: frozenset[str]  # the training backends that implement it
    auto_class: str = "AutoModelForCausalLM"  # the transformers class its model loads as
    peft_task_type: str = "CAUSAL_LM"  # the PEFT task type of its LoRA adapter
    splits: frozenset[str] | None = None  # the mesh dimensions it can split over (None: every one)
    # (model_dir, family, options) -> the options loss_sum takes, checked and completed from the checkpoint
    resolve_options: Callable[[Path, Any, dict], dict] | None = None
    prepare_model: Callable[[Any], None] | None = None  # e.g. freeze parts the objective never uses
    # (model, family, options) -> names of the linear layers in the parts it freezes (LoRA leaves them out)
    freeze_parts: Callable[[Any, Any, dict], tuple[str, ...]] | None = None
    # (model, resolved options), when the optimizer is set (the adapter, if any, is in place): e.g. a reference copy
    prepare_training: Callable[[Any, dict], None] | None = None
    export: Callable[..., Path] | None = None  # (model, saved_dir, output_dir) -> the registered form
    option_names: tuple[str, ...] = field(default=())
    embeds: bool = False  # trains embedding models (families with a pooling), and only those
    # Contrastive objectives that accumulate exactly through cached embeddings (twinkle_core.models.cached_step):
    embed: Callable | None = None  # (model, batch, **options) -> (query embeddings, document embeddings)
    loss_from_embeddings: Callable | None = None  # (queries, docs, batch, group, **options) -> LossParts
    # resolved options -> the row encoder's options (rows passed to forward_backward as they are)
    encode_options: Callable[[dict], dict] = lambda options: {}

    def options(self, model_dir: Path, family, options: dict | None) -> dict:
        """The loss options for this model (an objective without options refuses any)."""
        options = dict(options or {})
        unknown = sorted(set(options) - set(self.option_names))
        if unknown:
            raise ValueError(f"objective {self.name!r} takes no option(s) {unknown}; it takes "
                             f"{list(self.option_names) or 'none'}")
        return self.resolve_options(model_dir, family, options) if self.resolve_options else options


_OBJECTIVES: Registry[Objective] = Registry("objective", "training objective")


def register_objective(objective: Objective) -> Objective:
    """Add an objective; a name can be registered only once."""
    return _OBJECTIVES.register(objective.name, objective)


def get_objective(name: str) -> Objective:
    return _OBJECTIVES.get(name)


register_objective(Objective("causal_lm", "chat", causal_lm_loss_sum, frozenset({"transformers", "megatron"})))
from twinkle_core.objectives import embedding as _embedding  # noqa: E402,F401  (registers infonce)
from twinkle_core.objectives import preference as _preference  # noqa: E402,F401  (registers preference)
from twinkle_core.objectives import grpo as _grpo  # noqa: E402,F401  (registers grpo)
from twinkle_core.objectives import vision as _vision  # noqa: E402,F401  (registers vision_lm)

__all__ = ["LossParts", "Objective", "get_objective", "register_objective"]
