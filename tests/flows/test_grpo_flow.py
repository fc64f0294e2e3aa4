"""The grpo flow end to end on a tiny Llama: tokenize prompts → rollouts ↔ updates → greedy held-out
evaluation → register, with a user's reward function named module:function, under a real Prefect API,
MLflow store and torchrun."""
from __future__ import annotations

import json

import pytest
from mlflow import MlflowClient

from flows.grpo import GRPOConfig, grpo

PROMPTS = ["What is 3 + 4?", "hi", "Who are you?", "2 + 5 = ?"]


def _prompts(path, rows):
    path.write_text("".join(json.dumps({"prompt": q, "solution": "7"}) + "\n" for q in rows))
    return path


def test_grpo_flow_raises_the_reward_with_a_user_reward_function(sft_workspace, monkeypatch):
    root = sft_workspace["root"]
    # A user's reward: short completions score higher (the tiny model learns to stop early).
    (root / "user_rewards.py").write_text(
        "def short(prompts, completions, solution, **kwargs):\n"
        "    assert solution == ['7'] * len(completions)  # the row's fields arrive, one per completion\n"
        "    return [-min(len(c), 60) / 60 for c in completions]\n")
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.setenv("PYTHONPATH", str(root))  # the torchrun workers import it too
    config = GRPOConfig(model_id=str(sft_workspace["model"]), dataset=str(_prompts(root / "p.jsonl", PROMPTS * 2)),
                        eval_dataset=str(_prompts(root / "h.jsonl", PROMPTS)), rewards=["user_rewards:short"],
                        mixed_precision="no", max_steps=10, batch_size=4, num_generations=4, max_completion_length=16,
                        lr=5e-2, use_lora=False, max_length=64, registered_model_name="tiny-grpo",
                        output_dir=str(root / "runs"), timeout_minutes=10, eval_tasks=["twinkle_corpus"],
                        eval_limit=2)
    result = grpo(config)
    client = MlflowClient()
    rewards = [m.value for m in client.get_metric_history(result["run_id"], "reward")]
    assert len(rewards) == 10
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3  # the reward rises during training
    for name in ("rewards/user_rewards:short", "reward_std", "completion_length", "clip_fraction", "entropy",
                 "rollout_s", "update_s", "loss"):
        assert len(client.get_metric_history(result["run_id"], name)) == 10, name
    base, trained = result["reports"]["base"], result["reports"]["trained"]
    assert trained["prompts"] == 4 and len(trained["answers"]) == 3
    assert f"base mean reward: {base['mean_reward']:.4f}" in result["summary"]
    assert f"trained mean reward: {trained['mean_reward']:.4f}" in result["summary"]
    run = client.get_run(result["run_id"])
    assert run.data.metrics["eval_mean_reward"] == pytest.approx(trained["mean_reward"])
    assert client.get_model_version_by_alias("tiny-grpo", "champion").run_id == result["run_id"]
    # --eval-tasks on a full fine-tune: the trained checkpoint scored as it is, beside the base
    assert run.data.metrics["bench/twinkle_corpus/word_perplexity"] != \
        run.data.metrics["base_bench/twinkle_corpus/word_perplexity"]


def test_grpo_refuses_what_it_cannot_run(tmp_path):
    with pytest.raises(ValueError, match="backend='megatron': the grpo objective runs on transformers"):
        GRPOConfig(model_id=str(tmp_path), backend="megatron")
    with pytest.raises(ValueError, match="tp_size=2: the grpo objective splits over dp, fsdp only"):
        GRPOConfig(model_id=str(tmp_path), nproc_per_node=2, tp_size=2)
    with pytest.raises(ValueError, match="num_generations"):
        GRPOConfig(model_id=str(tmp_path), num_generations=1)
    with pytest.raises(ValueError, match=r"reward_weights=\[1.0\]: 1 weights for 2 rewards"):
        GRPOConfig(model_id=str(tmp_path), rewards=["format", "numeric_match"], reward_weights=[1.0])
    with pytest.raises(ValueError, match="rewards: reward 'no_such_module_xyz:f': cannot import module"):
        GRPOConfig(model_id=str(tmp_path), rewards=["no_such_module_xyz:f"])
    assert GRPOConfig(model_id=str(tmp_path), rewards=["exact_match"]).reward_weights is None  # not the default's
