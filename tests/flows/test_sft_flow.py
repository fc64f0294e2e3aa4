"""The sft flow end to end on a tiny model under a real Prefect API, MLflow store and torchrun."""
import json
from pathlib import Path

from mlflow import MlflowClient
from prefect.client.orchestration import get_client
from prefect.settings import get_current_settings
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

from flows.cli import parse_args
from flows.run_folder import resuming
from flows.sft import SFTConfig, sft
from twinkle_core.tracking import tracking_uri


def _config(ws, **overrides) -> SFTConfig:
    values = dict(model_id=str(ws["model"]), dataset=str(ws["train"]), eval_dataset=str(ws["heldout"]),
                  mixed_precision="no", max_steps=3, batch_size=4, lr=1e-2, max_length=64, eval_prompts=1,
                  max_new_tokens=4, registered_model_name="tiny-sft", output_dir=str(ws["root"] / "runs"),
                  timeout_minutes=10)
    values.update(overrides)
    return SFTConfig(**values)


def _task_states(flow_run_id) -> dict[str, str]:
    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    return {run.name.rsplit("-", 1)[0] + ":" + str(i): run.state.name for i, run in enumerate(
        sorted(runs, key=lambda r: r.expected_start_time))}


def _states_by_task(flow_run_id) -> dict[str, list[str]]:
    states: dict[str, list[str]] = {}
    for key, state in _task_states(flow_run_id).items():
        states.setdefault(key.split(":")[0], []).append(state)
    return states


def test_sft_trains_logs_registers_and_caches(sft_workspace):
    ws = sft_workspace
    state = sft(_config(ws, checkpoint_every=1), return_state=True)  # training states after steps 1 and 2
    result = state.result()
    client = MlflowClient(tracking_uri())
    run = client.get_run(result["run_id"])
    assert run.info.status == "FINISHED"
    assert run.data.params["lr"] == "0.01" and run.data.params["model_id"] == str(ws["model"])
    losses = client.get_metric_history(result["run_id"], "loss")
    assert [m.step for m in losses] == [1, 2, 3]
    for name in ("grad_norm", "lr", "tokens_per_s", "eval_loss", "eval_perplexity", "base_eval_loss"):
        assert name in run.data.metrics, name
    assert run.data.metrics["eval_loss"] == result["reports"]["trained"]["eval_loss"]
    version = client.get_model_version_by_alias("tiny-sft", "candidate")
    assert str(version.version) == "1" and version.run_id == result["run_id"]
    assert str(client.get_model_version_by_alias("tiny-sft", "champion").version) == "1"
    artifacts = {a.path for a in client.list_artifacts(result["run_id"], "model")}
    assert "model/MLmodel" in artifacts  # an MLflow model (its adapter under model/artifacts/)
    assert "chat with it: python -m flows.chat --model models:/tiny-sft/1" in result["summary"]
    assert "base answer: " in result["summary"] and "trained answer: " in result["summary"]
    assert f"MLflow run id: {result['run_id']}" in result["summary"]
    first = _states_by_task(state.state_details.flow_run_id)
    assert first["download_model"] == ["Completed"] and set(first["tokenize"]) == {"Completed"}
    # Cached task results are stored as JSON, never as pickles (tasks/download.py): a cache hit runs no code.
    storage = Path(get_current_settings().results.local_storage_path)
    records = [json.loads(f.read_text()) for f in storage.iterdir() if f.is_file()
               and str(ws["model"]) in f.read_text(errors="ignore")]
    assert records and {r["metadata"]["serializer"]["type"] for r in records} == {"json"}

    # `--resume FOLDER` (flows.cli): the first run again in its folder, from its saved parameters and its last
    # training state (step 2). Download and tokenize come from the cache; step 3 repeats exactly; a second
    # version is registered.
    folder = next((ws["root"] / "runs").glob("*/parameters.json")).parent
    assert parse_args(SFTConfig, ["--resume", str(folder)], "d")[:2] == (_config(ws, checkpoint_every=1), folder)
    with resuming(folder):
        state2 = sft(_config(ws, checkpoint_every=1), return_state=True)
    assert "resumed from step 2" in state2.result()["summary"]
    resumed = client.get_metric_history(state2.result()["run_id"], "loss")
    assert [(m.step, round(m.value, 6)) for m in resumed] == [(3, round(losses[2].value, 6))]
    assert len(list((ws["root"] / "runs").iterdir())) == 1
    second = _states_by_task(state2.state_details.flow_run_id)
    assert second["download_model"] == ["Cached"]
    assert second["download_dataset"] == ["Cached", "Cached"]
    assert second["tokenize"] == ["Cached", "Cached"]
    result2 = state2.result()
    assert result2["registration"]["version"] == "2"
    promoted = result2["reports"]["trained"]["eval_loss"] < result["reports"]["trained"]["eval_loss"]
    assert result2["registration"]["promoted"] == promoted

    # Editing the training file invalidates its download and tokenize cache entries.
    with open(ws["train"], "a") as handle:
        handle.write(json.dumps({"messages": [{"role": "user", "content": "Name?"},
                                              {"role": "assistant", "content": "Twinkle."}]}) + "\n")
    state3 = sft(_config(ws), return_state=True)
    third = _states_by_task(state3.state_details.flow_run_id)
    assert sorted(third["tokenize"]) == ["Cached", "Completed"]
    assert state3.result()["registration"]["version"] == "3"


def test_bad_data_fails_the_flow_with_file_and_line(sft_workspace):
    ws = sft_workspace
    bad = ws["root"] / "bad.jsonl"
    bad.write_text('{"messages": [{"role": "user", "content": "hi"}]}\nnot json\n')
    state = sft(_config(ws, dataset=str(bad)), return_state=True)
    assert state.is_failed()
    message = str(state.result(raise_on_failure=False))
    assert "bad.jsonl:1" in message and "bad.jsonl:2" in message
