"""MLflow run bookkeeping for a flow run: one MLflow run per flow run."""
from __future__ import annotations

from mlflow import MlflowClient
from prefect import get_run_logger, task

from twinkle_core.tracking import redact, tracking_uri


@task
def start_tracking(experiment_name: str, run_name: str, params: dict, tags: dict[str, str]) -> str:
    """Create the MLflow run and log the full config (secrets redacted); return its run id."""
    client = MlflowClient(tracking_uri())
    experiment = client.get_experiment_by_name(experiment_name)
    experiment_id = experiment.experiment_id if experiment else client.create_experiment(experiment_name)
    run = client.create_run(experiment_id, run_name=run_name, tags=tags)
    from mlflow.entities import Param

    flat = redact(params)
    items = [Param(k, v) for k, v in flat.items()]
    for start in range(0, len(items), 100):
        client.log_batch(run.info.run_id, params=items[start:start + 100])
    get_run_logger().info("MLflow run %s in experiment %r (%s)", run.info.run_id, experiment_name, tracking_uri())
    return run.info.run_id


@task
def finish_tracking(run_id: str, status: str = "FINISHED") -> None:
    MlflowClient(tracking_uri()).set_terminated(run_id, status=status)
