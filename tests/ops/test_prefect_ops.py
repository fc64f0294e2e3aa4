"""Day-2 operations against a real Prefect server: deployments served by `python -m deployments.serve`,
runs created through the API (as the UI creates them), artifacts, MLflow links, the "gpu" concurrency
limit, schedules, parameter validation, cancellation and resume after a crash."""
import json
import os
import signal
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import pytest
from mlflow import MlflowClient
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, FlowRunFilter, FlowRunFilterId
from prefect.deployments import run_deployment
from prefect.exceptions import PrefectHTTPStatusError
from prefect.states import Cancelling, Scheduled

from deployments.presets import FLOWS
from twinkle_core.models.training_state import read_progress

TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "CRASHED"}
ROOT = Path(__file__).resolve().parents[2]
PREFECT = [sys.executable, "-m", "prefect"]


def tiny_config(served, output_dir: str, **overrides) -> dict:
    """A partial `config`: the flow's defaults fill in everything else."""
    return {"model_id": str(served["model"]), "dataset": str(served["train"]), "eval_dataset": str(served["train"]),
            "mixed_precision": "no", "max_steps": 40, "batch_size": 4, "lr": 2e-2, "max_length": 96,
            "eval_prompts": 1, "max_new_tokens": 4, "checkpoint_every": 3, "registered_model_name": "tiny-ops",
            "output_dir": str(served["root"] / output_dir), **overrides}


def start(config: dict, deployment: str = "sft/default"):
    return run_deployment(deployment, parameters={"config": config}, timeout=0)


def wait_for(flow_run_id, states=TERMINAL, timeout_s: float = 300):
    deadline = time.monotonic() + timeout_s
    with get_client(sync_client=True) as client:
        while time.monotonic() < deadline:
            run = client.read_flow_run(flow_run_id)
            if run.state.type.value in states:
                return run
            time.sleep(0.5)
    raise TimeoutError(f"flow run {flow_run_id} still {run.state.name} after {timeout_s} s")


def artifacts_of(flow_run_id) -> dict:
    with get_client(sync_client=True) as client:
        found = client.read_artifacts(artifact_filter=ArtifactFilter(
            flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])))
    return {a.key or a.type: a for a in found}


def worker_processes(marker: str) -> list[int]:
    """Live processes whose command line names `marker` (the run's output folder: torchrun and its workers)."""
    pids = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if marker in cmdline.read_bytes().decode(errors="replace"):
                state = (cmdline.parent / "stat").read_text().rsplit(")", 1)[1].split()[0]
                if state not in ("Z", "X"):
                    pids.append(int(cmdline.parent.name))
        except OSError:
            continue
    return pids


def wait_until(condition, timeout_s: float = 180, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.2)
    raise TimeoutError(what)


def losses(run_id: str) -> dict[int, float]:
    return {m.step: m.value for m in MlflowClient(os.environ["MLFLOW_TRACKING_URI"]).get_metric_history(run_id, "loss")}


@pytest.fixture(scope="module", autouse=True)
def mlflow_store(served):
    old = os.environ.get("MLFLOW_TRACKING_URI")
    os.environ["MLFLOW_TRACKING_URI"] = served["env"]["MLFLOW_TRACKING_URI"]
    yield
    if old is None:
        os.environ.pop("MLFLOW_TRACKING_URI")
    else:
        os.environ["MLFLOW_TRACKING_URI"] = old


@pytest.fixture(scope="module")
def completed_run(served):
    """One run with partial parameters, started while the test holds the only "gpu" slot."""
    with get_client(sync_client=True) as client:
        lease = client.increment_concurrency_slots_with_lease(names=["gpu"], slots=1, mode="concurrency",
                                                               lease_duration=120).json()["lease_id"]
        flow_run = start(tiny_config(served, "runs-complete"))
        # The run gets as far as training, then waits for the slot: no worker starts.
        wait_until(lambda: "taking 1 slot(s)" in served["log"].read_text(), what="train task waiting for a slot")
        time.sleep(3)
        waited_without_workers = not worker_processes(str(served["root"] / "runs-complete"))
        client.release_concurrency_slots_with_lease(lease)
    return wait_for(flow_run.id), waited_without_workers


def test_a_run_with_partial_parameters_completes_with_artifacts_and_mlflow_links(served, completed_run):
    run, waited_without_workers = completed_run
    assert waited_without_workers  # the "gpu" limit held training back while the slot was taken
    assert run.state.type.value == "COMPLETED", served["log"].read_text()[-4000:]
    assert run.parameters["config"]["lr"] == 2e-2 and "lora_r" not in run.parameters["config"]
    artifacts = artifacts_of(run.id)
    assert {"training-progress", "eval-results", "sft-summary", "mlflow-run", "evaluation"} <= set(artifacts)
    assert artifacts["training-progress"].data == 100.0
    assert artifacts["training-progress"].description.startswith("step 40/40")
    table = json.loads(artifacts["eval-results"].data) if isinstance(artifacts["eval-results"].data, str) \
        else artifacts["eval-results"].data
    assert [row["model"] for row in table] == ["base", "trained"]

    client = MlflowClient(os.environ["MLFLOW_TRACKING_URI"])
    [mlflow_run] = client.search_runs(client.get_experiment_by_name("twinkle-sft").experiment_id,
                                      f"tags.prefect_flow_run = '{run.id}'")
    summary = artifacts["sft-summary"].data
    assert f"MLflow run id: {mlflow_run.info.run_id}" in summary
    assert "registered model: tiny-ops version 1" in summary
    assert f"get-artifact?path=plots%2Floss_curve.png&run_uuid={mlflow_run.info.run_id}" in summary
    assert mlflow_run.info.run_id in artifacts["mlflow-run"].data
    assert mlflow_run.data.params["lora_r"] == "8"  # the default filled in
    assert mlflow_run.data.tags["prefect_deployment"] == "sft/default"
    assert mlflow_run.data.tags["prefect_flow_run_name"] == run.name
    assert sorted(losses(mlflow_run.info.run_id)) == list(range(1, 41))
    png = Path(client.download_artifacts(mlflow_run.info.run_id, "plots/loss_curve.png", str(served["root"])))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    version = client.get_model_version("tiny-ops", "1")
    assert version.run_id == mlflow_run.info.run_id and version.tags["prefect_flow_run"] == str(run.id)


def test_invalid_parameters_are_rejected_before_any_task_naming_the_field(served):
    # Ranges and enums are in the deployment's parameter schema: the server refuses to create the run.
    with pytest.raises(PrefectHTTPStatusError) as err:
        start(tiny_config(served, "runs-invalid", lr=-1))
    assert "lr" in str(err.value.response.text) and "0" in str(err.value.response.text)
    with pytest.raises(PrefectHTTPStatusError) as err:
        start(tiny_config(served, "runs-invalid", mixed_precision="fp4"))
    assert "mixed_precision" in err.value.response.text or "fp4" in err.value.response.text
    # Rules across fields (fp8 needs a GPU) are the config's validators: the run fails before any task.
    flow_run = start(tiny_config(served, "runs-invalid", mixed_precision="fp8"))
    run = wait_for(flow_run.id)
    assert run.state.type.value == "FAILED" and "mixed_precision" in run.state.message + served["log"].read_text()
    with get_client(sync_client=True) as client:
        assert client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run.id]))) == []


def test_cancelling_a_run_stops_its_training_workers_within_seconds(served):
    output = served["root"] / "runs-cancel"
    flow_run = start(tiny_config(served, "runs-cancel", max_steps=100000, checkpoint_every=5))
    wait_until(lambda: list(output.glob("*/checkpoints/training_state/step-*/manifest.json")),
               what="training steps")
    assert worker_processes(str(output))
    with get_client(sync_client=True) as client:
        cancelled_at = time.monotonic()
        client.set_flow_run_state(flow_run.id, Cancelling())
    wait_until(lambda: not worker_processes(str(output)), timeout_s=60, what="workers gone")
    workers_gone_s = time.monotonic() - cancelled_at
    run = wait_for(flow_run.id, timeout_s=60)
    state_s = time.monotonic() - cancelled_at
    assert run.state.type.value == "CANCELLED"
    print(f"cancel: workers gone after {workers_gone_s:.1f} s, flow run Cancelled after {state_s:.1f} s")
    assert workers_gone_s < 15


def test_a_crashed_run_retried_resumes_with_the_uninterrupted_losses(served, completed_run):
    output = served["root"] / "runs-crash"
    flow_run = start(tiny_config(served, "runs-crash"))
    states = wait_until(lambda: list(output.glob("*/checkpoints/training_state/step-*/manifest.json")), what="a state")
    for pid in worker_processes(str(output)):  # the machine "crashes": torchrun and its workers die at once
        os.kill(pid, signal.SIGKILL)
    saved_step = read_progress(states[0].parents[2])["step"]
    assert wait_for(flow_run.id).state.type.value == "FAILED"

    with get_client(sync_client=True) as client:  # what the UI's Retry and `prefect flow-run retry` do
        client.set_flow_run_state(flow_run.id, Scheduled(), force=True)
    run = wait_for(flow_run.id)
    assert run.state.type.value == "COMPLETED", served["log"].read_text()[-4000:]
    summary = artifacts_of(run.id)["sft-summary"].data
    resumed_from = int(summary.split("resumed from step ")[1].split()[0])
    assert resumed_from >= saved_step >= 3 and len(list(output.iterdir())) == 1  # the same run folder

    client = MlflowClient(os.environ["MLFLOW_TRACKING_URI"])
    experiment = client.get_experiment_by_name("twinkle-sft").experiment_id
    [retried] = client.search_runs(experiment, f"tags.prefect_flow_run = '{run.id}'")  # one MLflow run for both
    [reference] = client.search_runs(experiment, f"tags.prefect_flow_run = '{completed_run[0].id}'")
    after, expected = losses(retried.info.run_id), losses(reference.info.run_id)
    assert sorted(after) == list(range(1, 41))
    worst = max(abs(after[s] - expected[s]) for s in range(resumed_from + 1, 41))
    print(f"resumed from step {resumed_from}; largest loss difference vs the uninterrupted run: {worst:.2e}")
    assert worst < 1e-6


def test_the_nightly_schedule_and_prefect_yaml(served, prefect_server, tmp_path):
    from prefect.server.schemas.schedules import CronSchedule

    with get_client(sync_client=True) as client:
        nightly = client.read_deployment_by_name("sft/nightly")
    [schedule] = nightly.schedules
    assert (schedule.schedule.cron, schedule.schedule.timezone) == ("0 2 * * *", "Europe/Berlin")
    cron = CronSchedule(cron=schedule.schedule.cron, timezone=schedule.schedule.timezone)
    summer = cron._get_dates_generator(start=datetime(2026, 7, 1, 12, tzinfo=timezone.utc))
    winter = cron._get_dates_generator(start=datetime(2026, 1, 15, 12, tzinfo=timezone.utc))
    assert next(summer).astimezone(timezone.utc) == datetime(2026, 7, 2, 0, tzinfo=timezone.utc)  # 02:00 CEST
    assert next(winter).astimezone(timezone.utc) == datetime(2026, 1, 16, 1, tzinfo=timezone.utc)  # 02:00 CET

    # prefect.yaml declares the same presets for a process work pool; `prefect deploy --all` registers them.
    env = {**prefect_server["env"], "TWINKLE_FLOWS_DIR": str(ROOT)}
    subprocess.run([*PREFECT, "work-pool", "create", "twinkle-cpu", "--type", "process"], env=env, check=True,
                   capture_output=True)
    deployed = subprocess.run([*PREFECT, "--no-prompt", "deploy", "--all", "--prefect-file",
                               "deployments/prefect.yaml"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert deployed.returncode == 0, deployed.stdout + deployed.stderr
    with get_client(sync_client=True) as client:
        for name, preset in FLOWS["flows/sft.py:sft"].items():
            pooled = [d for d in client.read_deployments() if d.name == name and d.work_pool_name == "twinkle-cpu"
                      and d.entrypoint == "flows/sft.py:sft"]  # other flows have a "default" preset too
            assert len(pooled) == 1 and pooled[0].parameters == {"config": preset.parameters}, name
            assert [(s.schedule.cron, s.schedule.timezone) for s in pooled[0].schedules] == (
                [(preset.cron, preset.timezone)] if preset.cron else [])
