"""evaluate_retrieval: recall@1/10, MRR@10 and nDCG@10 of the base and trained embedding models."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from mlflow import MlflowClient
from prefect import get_run_logger, task
from prefect.artifacts import create_table_artifact

from tasks.refs import CheckpointRef, DatasetRef, ModelRef
from twinkle_core.embedding.settings import EmbeddingSettings
from twinkle_core.evaluate.retrieval import METRICS, RetrievalEvalConfig
from twinkle_core.launch import run_streaming
from twinkle_core.tracking import tracking_uri


def metric_key(name: str) -> str:
    """An MLflow metric name for a ranking metric: recall@1 -> recall_at_1."""
    return name.replace("@", "_at_")


@task
def evaluate_retrieval(model: ModelRef, checkpoint: CheckpointRef, heldout: DatasetRef, settings: EmbeddingSettings,
                       run_dir: str, max_length: int, max_bad_fraction: float = 0.01,
                       mlflow_run_id: str | None = None, timeout_s: float | None = None) -> dict:
    """Rank the held-out corpus for the held-out queries with both models, in one worker process."""
    log = get_run_logger()
    run_dir = Path(run_dir)
    config = RetrievalEvalConfig(
        models={"base": Path(model.path), "trained": Path(checkpoint.path)}, heldout_data=Path(heldout.path),
        pooling=settings.pooling, query_prompt=settings.query_prompt, max_length=max_length,
        max_bad_fraction=max_bad_fraction, result_path=run_dir / "eval.json")
    config_path = run_dir / "eval_config.json"
    config_path.write_text(config.model_dump_json(indent=2))
    run_streaming([sys.executable, "-m", "twinkle_core.evaluate.retrieval", str(config_path)], log.info,
                  timeout_s=timeout_s)
    reports = json.loads(config.result_path.read_text())
    if mlflow_run_id:
        client = MlflowClient(tracking_uri())
        for label, report in reports.items():
            prefix = "eval" if label == "trained" else f"{label}_eval"
            for name in METRICS:
                client.log_metric(mlflow_run_id, f"{prefix}_{metric_key(name)}", report[name])
        client.log_dict(mlflow_run_id, reports, "eval/report.json")
    create_table_artifact([{"model": label, **{name: round(report[name], 4) for name in METRICS}}
                           for label, report in reports.items()],
                          key="eval-results", description="held-out retrieval, base vs trained")
    return reports
