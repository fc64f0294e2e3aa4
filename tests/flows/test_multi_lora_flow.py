"""The multi_lora flow end to end on a tiny model under a real Prefect API, MLflow store and torchrun:
three tenants, one with a broken dataset that fails alone while the other two train, evaluate and register."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow import MlflowClient
from pydantic import ValidationError

from flows.multi_lora import MultiLoraConfig, TenantSpec, multi_lora
from twinkle_core.tracking import tracking_uri

ROOT = Path(__file__).resolve().parents[2]


def _tenant(ws, name, dataset=None, **overrides) -> TenantSpec:
    values = dict(name=name, dataset=str(dataset or ws["train"]), eval_dataset=str(ws["heldout"]), max_steps=3,
                  batch_size=4, lr=1e-2, lora_r=4, lora_alpha=8)
    return TenantSpec(**{**values, **overrides})


def test_three_tenants_one_broken_the_others_train_evaluate_and_register(sft_workspace):
    ws = sft_workspace
    broken = ws["root"] / "broken.jsonl"
    broken.write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n'
                      "not json at all\n")
    config = MultiLoraConfig(
        model_id=str(ws["model"]), mixed_precision="no", max_length=64, eval_prompts=1, max_new_tokens=4,
        registered_model_prefix="tiny", output_dir=str(ws["root"] / "runs"), timeout_minutes=10,
        tenants=[_tenant(ws, "alpha"), _tenant(ws, "broken", dataset=broken),
                 _tenant(ws, "gamma", max_steps=2, lora_r=2, lora_target_modules=["q_proj", "v_proj"], seed=3)])
    result = multi_lora(config, return_state=True).result()

    assert set(result["results"]) == {"alpha", "gamma"} and set(result["failures"]) == {"broken"}
    assert "broken.jsonl:2" in result["failures"]["broken"]  # the data error names the file and line
    client = MlflowClient(tracking_uri())
    assert client.get_run(result["run_id"]).info.status == "FINISHED"
    runs = {name: client.get_run(run_id) for name, run_id in result["tenant_runs"].items()}
    assert all(run.data.tags["mlflow.parentRunId"] == result["run_id"] for run in runs.values())
    assert runs["broken"].info.status == "FAILED" and "broken.jsonl:2" in runs["broken"].data.tags["error"]
    for name, steps in (("alpha", 3), ("gamma", 2)):  # each tenant its own step count, metrics and registry entry
        run = runs[name]
        assert run.info.status == "FINISHED"
        assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == list(range(1, steps + 1))
        assert run.data.metrics["eval_loss"] == result["results"][name]["reports"]["trained"]["eval_loss"]
        assert "base_eval_loss" in run.data.metrics and run.data.params["lora_r"] == str(config.tenants[
            [t.name for t in config.tenants].index(name)].lora_r)
        version = client.get_model_version_by_alias(f"tiny-{name}", "champion")
        assert str(version.version) == "1" and version.run_id == run.info.run_id
        assert "model/MLmodel" in {a.path for a in client.list_artifacts(run.info.run_id, "model")}
    assert result["results"]["alpha"]["probe_loss"] != result["results"]["gamma"]["probe_loss"]
    assert "| broken | FAILED: " in result["summary"] and "| alpha | trained |" in result["summary"]


def test_three_tenants_on_megatron_tp2_one_broken_the_others_train_evaluate_and_register(sft_workspace):
    ws = sft_workspace
    broken = ws["root"] / "broken.jsonl"
    broken.write_text("not json at all\n")
    config = MultiLoraConfig(
        model_id=str(ws["model"]), backend="megatron", nproc_per_node=2, tp_size=2, micro_batch_size=2,
        mixed_precision="no", max_length=64, eval_prompts=1, max_new_tokens=4, registered_model_prefix="tiny-mcore",
        output_dir=str(ws["root"] / "runs"), timeout_minutes=10,
        tenants=[_tenant(ws, "alpha"), _tenant(ws, "broken", dataset=broken),
                 _tenant(ws, "gamma", max_steps=2, lora_r=2, lora_target_modules=["q_proj", "k_proj", "v_proj"],
                         seed=3)])
    result = multi_lora(config, return_state=True).result()

    assert set(result["results"]) == {"alpha", "gamma"} and set(result["failures"]) == {"broken"}
    client = MlflowClient(tracking_uri())
    for name, steps in (("alpha", 3), ("gamma", 2)):
        reports = result["results"][name]["reports"]  # the exported PEFT adapter, evaluated on the HF model
        assert reports["trained"]["eval_loss"] < reports["base"]["eval_loss"]
        run = client.get_run(result["tenant_runs"][name])
        assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == list(range(1, steps + 1))
        assert client.get_model_version_by_alias(f"tiny-mcore-{name}", "champion").run_id == run.info.run_id
    adapter = Path(result["results"]["gamma"]["checkpoint"]) / "adapter_config.json"
    assert sorted(json.loads(adapter.read_text())["target_modules"]) == ["k_proj", "q_proj", "v_proj"]
    assert "on megatron" in result["summary"] and "| broken | FAILED: " in result["summary"]


def test_megatron_and_bad_tenant_lists_fail_before_anything_runs(tmp_path):
    with pytest.raises(ValidationError, match="backend='megatron': mixed_precision='fp16'"):
        MultiLoraConfig(backend="megatron", mixed_precision="fp16")
    with pytest.raises(ValidationError, match="tp=2 x pp=1 does not divide the 1 processes"):
        MultiLoraConfig(backend="megatron", tp_size=2)
    with pytest.raises(ValidationError, match="split the model on backend='megatron'"):
        MultiLoraConfig(tp_size=2, nproc_per_node=2)
    with pytest.raises(ValidationError, match=r"names \['a'\] appear more than once"):
        MultiLoraConfig(tenants=[TenantSpec(name="a", dataset="x.jsonl", eval_dataset="y.jsonl")] * 2)
    with pytest.raises(ValidationError, match=r"max_r=4 is below tenant rank lora_r=8"):
        MultiLoraConfig(max_r=4)
    with pytest.raises(ValidationError, match="name"):
        TenantSpec(name="a b", dataset="x.jsonl", eval_dataset="y.jsonl")
    out = subprocess.run([sys.executable, "-m", "flows.multi_lora", "--help"], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout
    assert "--tenants" in out and "--mixed-batches" in out
