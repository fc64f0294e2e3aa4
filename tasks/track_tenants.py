"""MLflow runs for the tenants of a multi-tenant flow run: one run each, nested under the flow's run."""
from __future__ import annotations

from mlflow import MlflowClient
from prefect import task

from tasks.track import start_tracking
from twinkle_core.tracking import tracking_uri

PARENT_TAG = "mlflow.parentRunId"  # what MLflow's UI nests runs by


@task
def start_tenant_tracking(experiment_name: str, parent_run_id: str, tenant: str, params: dict) -> str:
    """Create tenant `tenant`'s run under the flow's run and log its config; return its run id. A retry of
    the flow run continues the tenant's run of the first attempt (its parent run is continued too)."""
    client = MlflowClient(tracking_uri())
    experiment = client.get_experiment_by_name(experiment_name)
    earlier = client.search_runs([experiment.experiment_id], f"tags.`{PARENT_TAG}` = '{parent_run_id}' and "
                                 f"tags.tenant = '{tenant}'", max_results=1) if experiment else []
    if earlier:
        client.update_run(earlier[0].info.run_id, status="RUNNING")
        return earlier[0].info.run_id
    tags = {PARENT_TAG: parent_run_id, "tenant": tenant, "flow": "multi_lora"}
    return start_tracking.fn(experiment_name, tenant, params, tags)


@task
def fail_tenant_tracking(run_id: str, error: str) -> None:
    """Mark a tenant's run FAILED with its error (the other tenants' runs go on)."""
    client = MlflowClient(tracking_uri())
    client.set_tag(run_id, "error", error[:5000])
    client.set_terminated(run_id, status="FAILED")
