"""evaluate_retrieval: recall@1/10, MRR@10 and nDCG@10 of the base and trained embedding models."""
from __future__ import annotations

from pathlib import Path

from prefect import task
from prefect.artifacts import create_table_artifact

from tasks.eval_worker import log_eval_reports, run_eval_worker
from tasks.refs import CheckpointRef, DatasetRef, ModelRef
from twinkle_core.embedding.settings import EmbeddingSettings
from twinkle_core.evaluate.retrieval import METRICS, RetrievalEvalConfig


def metric_key(name: str) -> str:
    """An MLflow metric name for a ranking metric: recall@1 -> recall_at_1."""
    return name.replace("@", "_at_")


@task
def evaluate_retrieval(model: ModelRef, checkpoint: CheckpointRef, heldout: DatasetRef, settings: EmbeddingSettings,
                       run_dir: str, max_length: int, max_bad_fraction: float = 0.01,
                       mlflow_run_id: str | None = None, timeout_s: float | None = None) -> dict:
    """Rank the held-out corpus for the held-out queries with both models, in one worker process."""
    run_dir = Path(run_dir)
    config = RetrievalEvalConfig(
        models={"base": Path(model.path), "trained": Path(checkpoint.path)}, heldout_data=Path(heldout.path),
        pooling=settings.pooling, query_prompt=settings.query_prompt, max_length=max_length,
        max_bad_fraction=max_bad_fraction, result_path=run_dir / "eval.json")
    reports = run_eval_worker("twinkle_core.evaluate.retrieval", config, run_dir / "eval_config.json", timeout_s)
    log_eval_reports(mlflow_run_id, reports, lambda report: {metric_key(name): report[name] for name in METRICS})
    create_table_artifact([{"model": label, **{name: round(report[name], 4) for name in METRICS}}
                           for label, report in reports.items()],
                          key="eval-results", description="held-out retrieval, base vs trained")
    return reports
