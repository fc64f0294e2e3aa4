"""register: log the trained model to MLflow and create a registered version (candidate / champion)."""
from __future__ import annotations

from mlflow import MlflowClient
from prefect import get_run_logger, task

from tasks.refs import CheckpointRef
from twinkle_core.tracking import register_version, tracking_uri

ARTIFACT_PATH = "model"


@task
def register(checkpoint: CheckpointRef, name: str, mlflow_run_id: str, eval_loss: float,
             tags: dict[str, str] | None = None, metric: str = "eval_loss", higher_is_better: bool = False,
             extras: dict[str, str] | None = None) -> dict:
    """Upload the adapter/model as the run's artifact and register it; champion moves only if it wins.

    `eval_loss` is the run's `metric` (lower wins unless `higher_is_better`); `tags` (e.g. the Prefect flow
    run) go on the new model version; `extras` (artifact path -> folder) are uploaded beside it, e.g. the
    LoRA adapter of a merged embedding model.
    """
    client = MlflowClient(tracking_uri())
    client.log_artifacts(mlflow_run_id, checkpoint.path, ARTIFACT_PATH)
    for artifact_path, folder in (extras or {}).items():
        client.log_artifacts(mlflow_run_id, folder, artifact_path)
    result = register_version(client, name, mlflow_run_id, ARTIFACT_PATH, eval_loss, metric, higher_is_better)
    for key, value in (tags or {}).items():
        client.set_model_version_tag(name, result.version, key, value)
    get_run_logger().info("registered %s version %s: %s", name, result.version, result.decision())
    return {"name": result.name, "version": result.version, "promoted": result.promoted,
            "decision": result.decision(), "champion_version": result.champion_version,
            "champion_loss": result.champion_loss}
