"""evaluate_rewards: greedy answers to the held-out prompts, scored by the run's rewards, base vs trained."""
from __future__ import annotations

from pathlib import Path

from prefect import task
from prefect.artifacts import create_table_artifact

from tasks.eval_worker import log_eval_reports, run_eval_worker
from tasks.refs import CheckpointRef, ModelRef, TokenizedRef
from twinkle_core.evaluate.rewards import RewardEvalConfig

METRICS = ("mean_reward", "accuracy")


@task
def evaluate_rewards(model: ModelRef, checkpoint: CheckpointRef, heldout: TokenizedRef, run_dir: str,
                     mixed_precision: str, rewards: list[str], reward_weights: list[float] | None,
                     reward_options: dict, max_new_tokens: int, mlflow_run_id: str | None = None,
                     timeout_s: float | None = None) -> dict:
    """Score base and trained in one worker process; log to MLflow and a table artifact."""
    run_dir = Path(run_dir)
    config = RewardEvalConfig(
        model_path=Path(model.path), **model.ref_options(),
        checkpoints={"base": None, "trained": Path(checkpoint.path)}, heldout_data=Path(heldout.path),
        rewards=rewards, reward_weights=reward_weights, reward_options=reward_options,
        max_new_tokens=max_new_tokens, mixed_precision=mixed_precision, result_path=run_dir / "eval.json")
    reports = run_eval_worker("twinkle_core.evaluate.rewards", config, run_dir / "eval_config.json", timeout_s)
    log_eval_reports(mlflow_run_id, reports, lambda report: {
        name.replace("/", "_"): value for name, value in report.items() if isinstance(value, float)})
    create_table_artifact([{"model": label, **{name: round(report[name], 4) for name in METRICS}}
                           for label, report in reports.items()],
                          key="eval-results", description="held-out prompts, greedy answers, base vs trained")
    return reports
