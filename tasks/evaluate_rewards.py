"""evaluate_rewards: greedy answers to the held-out prompts, scored by the run's rewards, base vs trained."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from mlflow import MlflowClient
from prefect import get_run_logger, task
from prefect.artifacts import create_table_artifact

from tasks.refs import CheckpointRef, ModelRef, TokenizedRef
from twinkle_core.evaluate.rewards import RewardEvalConfig
from twinkle_core.launch import run_streaming
from twinkle_core.tracking import tracking_uri

METRICS = ("mean_reward", "accuracy")


@task
def evaluate_rewards(model: ModelRef, checkpoint: CheckpointRef, heldout: TokenizedRef, run_dir: str,
                     mixed_precision: str, rewards: list[str], reward_weights: list[float] | None,
                     reward_options: dict, max_new_tokens: int, mlflow_run_id: str | None = None,
                     timeout_s: float | None = None) -> dict:
    """Score base and trained in one worker process; log to MLflow and a table artifact."""
    log = get_run_logger()
    run_dir = Path(run_dir)
    config = RewardEvalConfig(
        model_path=Path(model.path), **model.ref_options(),
        checkpoints={"base": None, "trained": Path(checkpoint.path)}, heldout_data=Path(heldout.path),
        rewards=rewards, reward_weights=reward_weights, reward_options=reward_options,
        max_new_tokens=max_new_tokens, mixed_precision=mixed_precision, result_path=run_dir / "eval.json")
    config_path = run_dir / "eval_config.json"
    config_path.write_text(config.model_dump_json(indent=2))
    run_streaming([sys.executable, "-m", "twinkle_core.evaluate.rewards", str(config_path)], log.info,
                  timeout_s=timeout_s)
    reports = json.loads(config.result_path.read_text())
    if mlflow_run_id:
        client = MlflowClient(tracking_uri())
        for label, report in reports.items():
            prefix = "eval" if label == "trained" else f"{label}_eval"
            for name, value in report.items():
                if isinstance(value, float):
                    client.log_metric(mlflow_run_id, f"{prefix}_{name.replace('/', '_')}", value)
        client.log_dict(mlflow_run_id, reports, "eval/report.json")
    create_table_artifact([{"model": label, **{name: round(report[name], 4) for name in METRICS}}
                           for label, report in reports.items()],
                          key="eval-results", description="held-out prompts, greedy answers, base vs trained")
    return reports
