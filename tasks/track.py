"""MLflow run bookkeeping for a flow run: one MLflow run per flow run, linked both ways with Prefect."""
from __future__ import annotations

import tempfile
from pathlib import Path

from mlflow import MlflowClient
from prefect import get_run_logger, task
from prefect.runtime import deployment, flow_run
from prefect.settings import get_current_settings

from twinkle_core.tracking import LOSS_CURVE, plot_loss_curve, redact, tracking_uri
from twinkle_core.tracking.logger import experiment_id


def prefect_tags(flow: str) -> dict[str, str]:
    """MLflow tags that lead back to the Prefect flow run (and its deployment, when it has one)."""
    tags = {"flow": flow, "prefect_flow_run": str(flow_run.id), "prefect_flow_run_name": str(flow_run.name)}
    if deployment.id:
        tags["prefect_deployment"] = f"{flow}/{deployment.name}"
    ui = get_current_settings().ui_url
    if ui and flow_run.id:
        tags["prefect_flow_run_url"] = f"{ui.rstrip('/')}/runs/flow-run/{flow_run.id}"
    return tags


@task
def start_tracking(experiment_name: str, run_name: str, params: dict, tags: dict[str, str]) -> str:
    """Create the MLflow run and log the full config (secrets redacted); return its run id.

    A retry of the same Prefect flow run continues the MLflow run it started, so a resumed training's
    steps extend the first attempt's metric history.
    """
    client = MlflowClient(tracking_uri())
    experiment = experiment_id(client, experiment_name)
    earlier = client.search_runs([experiment], f"tags.prefect_flow_run = '{tags['prefect_flow_run']}'",
                                 max_results=1) if tags.get("prefect_flow_run", "None") != "None" else []
    if earlier:
        run_id = earlier[0].info.run_id
        client.update_run(run_id, status="RUNNING")
        get_run_logger().info("continuing MLflow run %s of this flow run's first attempt", run_id)
        return run_id
    run = client.create_run(experiment, run_name=run_name, tags=tags)
    from mlflow.entities import Param

    items = [Param(k, v) for k, v in redact(params).items()]
    for start in range(0, len(items), 100):
        client.log_batch(run.info.run_id, params=items[start:start + 100])
    get_run_logger().info("MLflow run %s in experiment %r (%s)", run.info.run_id, experiment_name, tracking_uri())
    return run.info.run_id


@task
def log_loss_curve(run_id: str) -> str | None:
    """Plot the run's per-step training loss and log the PNG to MLflow; return its artifact path."""
    client = MlflowClient(tracking_uri())
    history = {m.step: m.value for m in client.get_metric_history(run_id, "loss")}  # a resumed step once
    if not history:
        return None
    steps = sorted(history)
    with tempfile.TemporaryDirectory() as tmp:
        png = plot_loss_curve(steps, [history[s] for s in steps], Path(tmp) / Path(LOSS_CURVE).name)
        client.log_artifact(run_id, str(png), str(Path(LOSS_CURVE).parent))
    return LOSS_CURVE


@task
def finish_tracking(run_id: str, status: str = "FINISHED") -> None:
    MlflowClient(tracking_uri()).set_terminated(run_id, status=status)
