"""Preference pairs scored by a model: the held-out evaluation of base vs trained, and the reference
log-probs that `precompute_reference` trains against.

    python -m twinkle_core.evaluate.preference evaluate EVAL_CONFIG.json
    python -m twinkle_core.evaluate.preference reference REFERENCE_CONFIG.json

Each runs in its own process, like training. Held-out metrics, for each model:
- reward_accuracy: the share of pairs whose chosen reply the model scores above the rejected one, the score
  being the objective's reward without its reference term: the reply's summed log-prob (sigmoid), its
  per-token mean (ipo, simpo, orpo). The base model's value is where training starts.
- margin: the mean of that score's chosen - rejected difference; logps_chosen / logps_rejected: the mean
  summed log-probs of the replies.
- for the trained model, DPO's own implicit rewards with the base as reference: dpo_reward_accuracy and
  dpo_reward_margin (beta * (log-ratio chosen - log-ratio rejected)), as trl reports them.
"""
from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import torch
from pydantic import Field

from twinkle_core.atomic import atomic_dir
from twinkle_core.config.fields import ModelLoadFields
from twinkle_core.data import load_tokenized
from twinkle_core.data.preference import REFERENCE_KEYS, collate_preferences
from twinkle_core.evaluate.run import load_model
from twinkle_core.hashing import hash_json
from twinkle_core.models import TransformersModel
from twinkle_core.objectives.preference import MEAN_LOGPS, sequence_logps
from twinkle_core.paths import cache_dir
from twinkle_core.entry import finish_worker, report_user_errors_in_one_line

logger = logging.getLogger(__name__)


class PreferenceEvalConfig(ModelLoadFields):
    model_path: Path
    checkpoints: dict[str, Path | None] = Field(description="label -> adapter/full checkpoint (None = base).")
    heldout_data: Path  # a tokenized preference dataset
    prompts: list[list[dict]] = Field(default_factory=list)
    max_new_tokens: int = 48
    batch_size: int = 8
    mixed_precision: str = "auto"
    loss_type: str = "sigmoid"
    beta: float = 0.1
    result_path: Path


class ReferenceConfig(ModelLoadFields):
    model_path: Path
    data: Path  # a tokenized preference dataset
    content_hash: str  # of that dataset
    model_hash: str
    batch_size: int = 8
    mixed_precision: str = "auto"
    result_path: Path  # where the new dataset's folder is written (its path)


@torch.no_grad()
def pair_logps(model: TransformersModel, examples: list[dict], batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed reply log-probs and reply lengths, shape [pairs, 2] (chosen, rejected)."""
    model.model.eval()
    pad = model.tokenizer.pad_token_id if model.tokenizer.pad_token_id is not None else model.tokenizer.eos_token_id
    logps, tokens = [], []
    for start in range(0, len(examples), batch_size):
        chunk = examples[start:start + batch_size]
        batch = {k: v.to(model.device) for k, v in collate_preferences(chunk, pad).items()}
        with model.precision.autocast(model.device.type):
            row_logps, row_tokens = sequence_logps(model.model, batch)
        n = len(chunk)
        logps.append(torch.stack([row_logps[:n], row_logps[n:]], dim=1).float().cpu())
        tokens.append(torch.stack([row_tokens[:n], row_tokens[n:]], dim=1).cpu())
    return torch.cat(logps), torch.cat(tokens)


def preference_metrics(logps: torch.Tensor, tokens: torch.Tensor, loss_type: str) -> dict[str, float]:
    score = logps / tokens.clamp(min=1) if loss_type in MEAN_LOGPS else logps
    difference = score[:, 0] - score[:, 1]
    return {"reward_accuracy": float((difference > 0).float().mean()), "margin": float(difference.mean()),
            "logps_chosen": float(logps[:, 0].mean()), "logps_rejected": float(logps[:, 1].mean()),
            "pairs": int(logps.shape[0])}


def implicit_reward_metrics(logps: torch.Tensor, reference: torch.Tensor, beta: float) -> dict[str, float]:
    """DPO's rewards beta * (log pi - log ref), chosen against rejected."""
    ratio = beta * (logps - reference)
    margin = ratio[:, 0] - ratio[:, 1]
    return {"dpo_reward_accuracy": float((margin > 0).float().mean()), "dpo_reward_margin": float(margin.mean())}


def evaluate(config: PreferenceEvalConfig) -> dict[str, dict]:
    examples = load_tokenized(config.heldout_data)
    reports, base_logps = {}, None
    for label, checkpoint in config.checkpoints.items():
        model = load_model(config, checkpoint)
        logps, tokens = pair_logps(model, examples, config.batch_size)
        report = preference_metrics(logps, tokens, config.loss_type)
        if checkpoint is None:
            base_logps = logps
        elif base_logps is not None:
            report.update(implicit_reward_metrics(logps, base_logps, config.beta))
        report["answers"] = [model.generate(messages, max_new_tokens=config.max_new_tokens)
                             for messages in config.prompts]
        reports[label] = report
        logger.info("%s: reward accuracy %.4f, margin %.4f", label, report["reward_accuracy"], report["margin"])
        del model
    return reports


def reference_key(data_hash: str, model_hash: str, mixed_precision: str) -> str:
    return hash_json({"reference_logps": 1, "data": data_hash, "model": model_hash, "precision": mixed_precision})


def write_reference(config: ReferenceConfig) -> Path:
    """The dataset again, each pair with the reference model's summed log-probs of both replies (cached)."""
    key = reference_key(config.content_hash, config.model_hash, config.mixed_precision)
    final = cache_dir("tokenized") / f"ref-{key[:16]}"
    if (final / "meta.json").is_file():
        logger.info("reusing reference log-probs %s", final)
        return final
    from twinkle_core.data.tokenized import write_rows

    examples = list(load_tokenized(config.data))  # the rows gain two columns: a preference set is small
    logps, _ = pair_logps(load_model(config, None), examples, config.batch_size)
    for example, (chosen, rejected) in zip(examples, logps.tolist()):
        example[REFERENCE_KEYS[0]], example[REFERENCE_KEYS[1]] = float(chosen), float(rejected)
    meta = json.loads((Path(config.data) / "meta.json").read_text())
    meta.update(content_hash=key, reference_of=config.content_hash, reference_model=config.model_hash)
    with atomic_dir(final) as tmp:
        write_rows(examples, tmp)
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
    logger.info("reference log-probs of %d pairs in %s", len(examples), final)
    return final


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2 or argv[0] not in ("evaluate", "reference"):
        raise SystemExit("usage: python -m twinkle_core.evaluate.preference evaluate|reference CONFIG.json")
    report_user_errors_in_one_line()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    path = Path(argv[1])
    if argv[0] == "evaluate":
        config = PreferenceEvalConfig.model_validate_json(path.read_text())
        config.result_path.write_text(json.dumps(evaluate(config), indent=2))
    else:
        config = ReferenceConfig.model_validate_json(path.read_text())
        config.result_path.write_text(json.dumps({"path": str(write_reference(config))}))
    return 0


if __name__ == "__main__":
    finish_worker(main())
