"""One MLflow run around a flow's training stages, the same in every training flow.

    with TrackedRun(config, run_dir, "sft") as tracked:
        checkpoint = train(config.run_config(..., tracked.run_id), ...)
        ...register(..., tracked.run_id, ..., tracked.tags)

Entering starts the MLflow run (the config as params, tags leading back to the Prefect flow run) and adds
a link artifact to it; leaving plots the loss curve and ends the run FINISHED, or FAILED when a stage
raised (the error goes on). `links` holds the run's page and, after a success, the loss-curve image.
"""
from __future__ import annotations

from pathlib import Path

from mlflow import MlflowClient
from prefect.artifacts import create_link_artifact

from tasks.track import finish_tracking, log_loss_curve, prefect_tags, start_tracking
from twinkle_core.tracking import artifact_url, run_url, tracking_uri


def link_mlflow_run(experiment_name: str, run_id: str) -> dict[str, str]:
    """A link artifact to the MLflow run (the MLflow run carries this flow run's id and URL as tags)."""
    experiment_id = MlflowClient(tracking_uri()).get_experiment_by_name(experiment_name).experiment_id
    url = run_url(experiment_id, run_id)
    create_link_artifact(url, link_text=f"MLflow run {run_id}", key="mlflow-run", description="this run in MLflow")
    return {"run": url}


class TrackedRun:
    def __init__(self, config, run_dir: Path, flow: str):
        self.tags = prefect_tags(flow)
        self.run_id = start_tracking(config.experiment_name, run_dir.name, config.model_dump(mode="json"),
                                     {**self.tags, "model_id": config.model_id})
        self.links = link_mlflow_run(config.experiment_name, self.run_id)

    def __enter__(self) -> "TrackedRun":
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is None:
            try:
                curve = log_loss_curve(self.run_id)
            except BaseException:
                finish_tracking(self.run_id, "FAILED")
                raise
            finish_tracking(self.run_id)
            if curve:
                self.links["loss_curve"] = artifact_url(self.run_id, curve)
        else:
            finish_tracking(self.run_id, "FAILED")
        return False
