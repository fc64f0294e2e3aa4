"""Evaluate a base model and trained checkpoints: held-out loss, perplexity, greedy answers.

    python -m twinkle_core.evaluate EVAL_CONFIG.json   (writes the result JSON named in the config)

Runs in its own process, like training, so the orchestrator never holds a model.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

from pydantic import BaseModel, Field

from twinkle_core.config.fields import ModelLoadFields
from twinkle_core.data import get_row_format, load_tokenized
from twinkle_core.entry import worker_config_path
from twinkle_core.models import TransformersModel

logger = logging.getLogger(__name__)


class EvalRunConfig(ModelLoadFields):
    model_path: Path
    checkpoints: dict[str, Path | None] = Field(description="label -> adapter/full checkpoint (None = base).")
    heldout_data: Path
    prompts: list[list[dict]] = Field(default_factory=list, description="Conversations to answer greedily.")
    max_new_tokens: int = 48
    batch_size: int = 8
    mixed_precision: str = "auto"
    result_path: Path
    objective: str = "causal_lm"  # how the model loads and its held-out rows batch (vision_lm: with their media)
    objective_options: dict = Field(default_factory=dict)


class ModelReport(BaseModel):
    eval_loss: float
    perplexity: float
    eval_tokens: int
    answers: list[str]


def load_model(config, checkpoint: Path | None) -> TransformersModel:
    """The base model (checkpoint None), a full checkpoint, or the base with a saved adapter loaded."""
    if checkpoint is not None and not (checkpoint / "adapter_config.json").exists():
        return TransformersModel(str(checkpoint), mixed_precision=config.mixed_precision, **_options(config))
    model = TransformersModel(str(config.model_path), mixed_precision=config.mixed_precision, **_options(config))
    if checkpoint is not None:
        model.load(checkpoint.name, checkpoint.parent)
    return model


def _options(config) -> dict:
    """TransformersModel's keywords: the loading options, and the objective when it is not the default one."""
    options = config.load_options()
    if getattr(config, "objective", "causal_lm") != "causal_lm":
        options.update(objective=config.objective, objective_options=config.objective_options)
    return options


def evaluate_model(model: TransformersModel, examples: list[dict], config: EvalRunConfig) -> ModelReport:
    pad = model.tokenizer.pad_token_id if model.tokenizer.pad_token_id is not None else model.tokenizer.eos_token_id
    batch_rows = get_row_format(model.objective.row_kind).collate  # vision rows batch with their pixels
    for start in range(0, len(examples), config.batch_size):
        model.forward_only(batch_rows(examples[start:start + config.batch_size], pad_token_id=pad))
    metrics = model.calculate_metric(is_training=False)
    answers = [model.generate(messages, max_new_tokens=config.max_new_tokens) for messages in config.prompts]
    return ModelReport(eval_loss=metrics["loss"], perplexity=metrics["perplexity"],
                       eval_tokens=metrics["tokens"], answers=answers)


def main(argv: list[str] | None = None) -> int:
    path = worker_config_path(argv, "python -m twinkle_core.evaluate EVAL_CONFIG.json")
    config = EvalRunConfig.model_validate_json(path.read_text())
    examples = load_tokenized(config.heldout_data)
    reports = {}
    for label, checkpoint in config.checkpoints.items():
        reports[label] = evaluate_model(load_model(config, checkpoint), examples, config).model_dump()
        logger.info("%s: eval loss %.4f", label, reports[label]["eval_loss"])
    config.result_path.write_text(json.dumps(reports, indent=2))
    return 0
