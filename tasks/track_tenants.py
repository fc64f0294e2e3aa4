"""MLflow runs for the tenants of a multi-tenant flow run: one run each, nested under the flow's run."""
from __future__ import annotations

from mlflow import MlflowClient
from prefect import task

from tasks.track import start_tracking
from twinkle_core.tracking import tracking_uri

PARENT_TAG = "mlflow.parentRunId"  # what MLflow's UI nests runs by


@task
def start_tenant_tracking(experiment_name: str, parent_run_id: str, tenant: str, params: dict) -> str:
    """Create tenant `tenant`'s run under the flow's run and log its config; return its run id."""
    tags = {PARENT_TAG: parent_run_id, "tenant": tenant, "flow": "multi_lora"}
    return start_tracking.fn(experiment_name, tenant, params, tags)


@task
def fail_tenant_tracking(run_id: str, error: str) -> None:
    """Mark a tenant's run FAILED with its error (the other tenants' runs go on)."""
    client = MlflowClient(tracking_uri())
    client.set_tag(run_id, "error", error[:5000])
    client.set_terminated(run_id, status="FAILED")
