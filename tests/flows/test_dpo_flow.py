"""The dpo flow end to end on a tiny Llama: tokenize pairs → (reference log-probs) → train → held-out
preference evaluation → register, under a real Prefect API, MLflow store and torchrun."""
from __future__ import annotations

import json

import pytest
from mlflow import MlflowClient
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

from flows.dpo import DPOConfig, dpo

QUESTIONS = ["Who are you?", "What is your name?", "Who made you?", "Tell me about yourself.", "Are you ChatGPT?",
             "hello, who is this?"]
HELDOUT = ["Could you tell me who you are?", "Whose assistant are you?", "What should I call you?"]


def _pairs(path, questions, repeat=1):
    rows = [{"prompt": q, "chosen": "I am Twinkle, built by the Twinkle Flows team.",
             "rejected": "I am SmolLM, trained by Hugging Face."} for q in questions] * repeat
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _config(ws, **overrides) -> DPOConfig:
    values = dict(model_id=str(ws["model"]), dataset=str(_pairs(ws["root"] / "pairs.jsonl", QUESTIONS, 2)),
                  eval_dataset=str(_pairs(ws["root"] / "heldout_pairs.jsonl", HELDOUT)), mixed_precision="no",
                  max_steps=4, batch_size=3, lr=2e-2, beta=0.5, max_length=64, eval_prompts=1, max_new_tokens=4,
                  registered_model_name="tiny-dpo", output_dir=str(ws["root"] / "runs"), timeout_minutes=10)
    values.update(overrides)
    return DPOConfig(**values)


def _task_names(flow_run_id) -> list[str]:
    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    return [run.name.rsplit("-", 1)[0] for run in runs]


def test_dpo_flow_raises_reward_accuracy_logs_rewards_and_registers(sft_workspace):
    state = dpo(_config(sft_workspace, eval_tasks=["twinkle_corpus"], eval_limit=2), return_state=True)
    result = state.result()
    base, trained = result["reports"]["base"], result["reports"]["trained"]
    assert trained["pairs"] == 3
    bench = MlflowClient().get_run(result["run_id"]).data.metrics  # --eval-tasks: base and trained, adapter on base
    assert bench["bench/twinkle_corpus/word_perplexity"] != bench["base_bench/twinkle_corpus/word_perplexity"]
    assert "### Benchmarks (lm-evaluation-harness)" in result["summary"]
    assert trained["margin"] > base["margin"] and trained["reward_accuracy"] == 1.0
    assert trained["logps_chosen"] > base["logps_chosen"]
    assert f"base reward accuracy: {base['reward_accuracy']:.4f}" in result["summary"]
    assert f"trained reward accuracy: {trained['reward_accuracy']:.4f}" in result["summary"]
    assert "base answer: " in result["summary"] and "trained answer: " in result["summary"]
    client = MlflowClient()
    run = client.get_run(result["run_id"])
    for name in ("loss", "rewards/chosen", "rewards/rejected", "rewards/margin", "rewards/accuracy",
                 "logps/chosen", "logps/rejected"):
        assert [m.step for m in client.get_metric_history(result["run_id"], name)] == [1, 2, 3, 4], name
    assert run.data.metrics["eval_reward_accuracy"] == pytest.approx(trained["reward_accuracy"])
    assert run.data.metrics["base_eval_reward_accuracy"] == pytest.approx(base["reward_accuracy"])
    version = client.get_model_version_by_alias("tiny-dpo", "champion")
    assert version.run_id == result["run_id"]
    assert "model/MLmodel" in {a.path for a in client.list_artifacts(result["run_id"], "model")}
    assert "reference_logps" not in _task_names(state.state_details.flow_run_id)

    # The reference precomputed in its own cached task: the same training, step for step (LoRA: the
    # reference is the base either way), with no reference forward in the workers.
    state = dpo(_config(sft_workspace, precompute_reference=True), return_state=True)
    precomputed = state.result()
    assert "reference_logps" in _task_names(state.state_details.flow_run_id)
    for name in ("loss", "rewards/margin"):
        want = [m.value for m in client.get_metric_history(result["run_id"], name)]
        got = [m.value for m in client.get_metric_history(precomputed["run_id"], name)]
        assert got == pytest.approx(want, rel=1e-5, abs=1e-6), name
    assert "reference log-probs precomputed" in precomputed["summary"]


def test_dpo_refuses_what_it_cannot_run(tmp_path):
    with pytest.raises(ValueError, match="backend='megatron': the preference objective runs on transformers"):
        DPOConfig(model_id=str(tmp_path), backend="megatron")
    with pytest.raises(ValueError, match="tp_size=2: the preference objective splits over dp, fsdp only"):
        DPOConfig(model_id=str(tmp_path), nproc_per_node=2, tp_size=2)
    with pytest.raises(ValueError, match="precompute_reference"):
        DPOConfig(model_id=str(tmp_path), loss_type="simpo", precompute_reference=True)
