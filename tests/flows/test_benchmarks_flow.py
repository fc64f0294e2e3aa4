"""--eval-tasks through the sft flow on a tiny model: the scores equal lm-evaluation-harness's own API on the
same checkpoint and adapter, land in MLflow, may decide the champion, and a registered version is scored by
name with flows.evaluate."""
from __future__ import annotations

import subprocess
import sys

import lm_eval
import torch
from lm_eval.models.huggingface import HFLM
from lm_eval.tasks import TaskManager
from mlflow import MlflowClient
from transformers import AutoTokenizer

from flows.evaluate import EvaluateConfig, evaluate_registered
from flows.sft import SFTConfig, sft
from twinkle_core.evaluate.benchmarks import BUNDLED_TASKS, benchmark_metrics
from twinkle_core.tracking import tracking_uri

LIMIT = 4


def _direct(model_dir, adapter_dir) -> dict:
    """The harness alone: HFLM on the base with the PEFT adapter, chat-style tasks with the chat template."""
    lm = HFLM(pretrained=str(model_dir), peft=str(adapter_dir), tokenizer=AutoTokenizer.from_pretrained(model_dir),
              device="cpu", dtype=torch.float32, batch_size=8)
    manager = TaskManager(include_path=str(BUNDLED_TASKS), include_defaults=False)
    results = {}
    for tasks, chat in ((["twinkle_arithmetic", "twinkle_self_cognition"], True), (["twinkle_corpus"], False)):
        out = lm_eval.simple_evaluate(model=lm, tasks=tasks, task_manager=manager, limit=LIMIT, apply_chat_template=chat,
                                      log_samples=False, random_seed=1234, numpy_random_seed=1234,
                                      torch_random_seed=1234, fewshot_random_seed=1234)
        results.update(out["results"])
    return {"results": results}


def test_sft_benchmarks_equal_the_harness_land_in_mlflow_and_decide_the_champion(sft_workspace):
    ws = sft_workspace
    config = SFTConfig(model_id=str(ws["model"]), dataset=str(ws["train"]), eval_dataset=str(ws["heldout"]),
                       mixed_precision="no", max_steps=3, batch_size=4, lr=1e-2, max_length=64, eval_prompts=1,
                       max_new_tokens=4, registered_model_name="tiny-bench", output_dir=str(ws["root"] / "runs"),
                       timeout_minutes=10, eval_tasks=["twinkle"], eval_limit=LIMIT,
                       champion_metric="bench/twinkle_self_cognition/acc_norm")
    result = sft(config)
    bench = result["benchmarks"]
    trained, base = benchmark_metrics(bench["trained"]), benchmark_metrics(bench["base"])
    assert {"bench/twinkle_self_cognition/acc", "bench/twinkle_arithmetic/exact_match.first-number",
            "bench/twinkle_corpus/word_perplexity"} <= set(trained)
    assert trained["bench/twinkle_corpus/word_perplexity"] != base["bench/twinkle_corpus/word_perplexity"]
    direct = benchmark_metrics(_direct(ws["model"], result["checkpoint"]))
    assert set(direct) == set(trained)
    for name, value in direct.items():  # the flow's worker and the harness's own API: the same numbers
        assert abs(trained[name] - value) <= 1e-6 * max(1.0, abs(value)), (name, trained[name], value)

    client = MlflowClient(tracking_uri())
    run = client.get_run(result["run_id"])
    for name, value in trained.items():
        assert run.data.metrics[name] == value
    assert run.data.metrics["base_bench/twinkle_corpus/word_perplexity"] == base["bench/twinkle_corpus/word_perplexity"]
    artifacts = {a.path for a in client.list_artifacts(result["run_id"], "benchmarks")}
    assert artifacts == {"benchmarks/results_base.json", "benchmarks/results_trained.json", "benchmarks/summary.md"}
    assert "### Benchmarks (lm-evaluation-harness)" in result["summary"]
    assert "| task | measure | base | trained | change |" in result["summary"]
    registration = result["registration"]
    assert registration["promoted"] and "twinkle_self_cognition/acc_norm" in registration["decision"]

    # A retry scores nothing again: the worker finds base and trained in the cache.
    run_dir = next((ws["root"] / "runs").iterdir())
    again = subprocess.run([sys.executable, "-m", "twinkle_core.evaluate.harness", str(run_dir / "benchmarks_config.json")],
                           capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-2000:]
    assert again.stderr.count("benchmark scores from the cache") == 2, again.stderr[-2000:]

    # The registered version, by name: its scores equal the run's, and go on the version.
    found = evaluate_registered(EvaluateConfig(model="models:/tiny-bench/1", tasks=["twinkle_arithmetic"],
                                               limit=LIMIT, mixed_precision="no", output_dir=str(ws["root"] / "eval")))
    scored = benchmark_metrics(found["reports"]["trained"])
    assert scored == {name: value for name, value in trained.items() if "/twinkle_arithmetic/" in name}
    tags = client.get_model_version("tiny-bench", "1").tags
    for name, value in scored.items():
        assert float(tags[name]) == float(f"{value:.6g}")
