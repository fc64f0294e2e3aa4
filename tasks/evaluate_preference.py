"""Preference tasks: the reference log-probs of a tokenized preference set (cached), and the held-out
evaluation of base vs trained (reward accuracy, margin, log-probs, answers)."""
from __future__ import annotations

import json
from pathlib import Path

from prefect import get_run_logger, task
from prefect.artifacts import create_table_artifact
from prefect.cache_policies import INPUTS, TASK_SOURCE

from tasks.eval_worker import log_eval_reports, run_eval_worker
from tasks.refs import CheckpointRef, ModelRef, TokenizedRef
from twinkle_core.evaluate.preference import PreferenceEvalConfig, ReferenceConfig

METRICS = ("reward_accuracy", "margin", "logps_chosen", "logps_rejected")
TRAINED_ONLY = ("dpo_reward_accuracy", "dpo_reward_margin")


@task(cache_policy=INPUTS + TASK_SOURCE, persist_result=True, result_serializer="json")
def reference_logps(model: ModelRef, data: TokenizedRef, run_dir: str, mixed_precision: str = "auto",
                    timeout_s: float | None = None) -> TokenizedRef:
    """`data` with the reference (base) model's log-probs of every pair's replies, so that training needs no
    reference model; inputs carry content hashes, so a new model or data set re-runs this."""
    log = get_run_logger()
    run_dir = Path(run_dir)
    config = ReferenceConfig(model_path=Path(model.path), **model.ref_options(), data=Path(data.path),
                             content_hash=data.content_hash, model_hash=model.content_hash,
                             mixed_precision=mixed_precision, result_path=run_dir / "reference.json")
    path = run_eval_worker("twinkle_core.evaluate.preference", config, run_dir / "reference_config.json", timeout_s,
                           "reference")["path"]
    meta = json.loads((Path(path) / "meta.json").read_text())
    log.info("reference log-probs of %d pairs: %s", data.num_rows, path)
    return data.model_copy(update={"path": path, "content_hash": meta["content_hash"]})


@task
def evaluate_preference(model: ModelRef, checkpoint: CheckpointRef, heldout: TokenizedRef, prompts: list[list[dict]],
                        run_dir: str, mixed_precision: str, loss_type: str, beta: float, max_new_tokens: int = 48,
                        mlflow_run_id: str | None = None, timeout_s: float | None = None) -> dict:
    """Score the held-out pairs with base and trained in one worker process; log to MLflow and an artifact."""
    run_dir = Path(run_dir)
    config = PreferenceEvalConfig(
        model_path=Path(model.path), **model.ref_options(),
        checkpoints={"base": None, "trained": Path(checkpoint.path)}, heldout_data=Path(heldout.path),
        prompts=prompts, max_new_tokens=max_new_tokens, mixed_precision=mixed_precision, loss_type=loss_type,
        beta=beta, result_path=run_dir / "eval.json")
    reports = run_eval_worker("twinkle_core.evaluate.preference", config, run_dir / "eval_config.json", timeout_s,
                              "evaluate")
    log_eval_reports(mlflow_run_id, reports,
                     lambda report: {name: report[name] for name in METRICS + TRAINED_ONLY if name in report})
    create_table_artifact([{"model": label, **{name: round(report[name], 4) for name in METRICS}}
                           for label, report in reports.items()],
                          key="eval-results", description="held-out preference pairs, base vs trained")
    return reports
