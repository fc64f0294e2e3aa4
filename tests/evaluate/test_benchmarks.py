"""Benchmarks through lm-evaluation-harness, without a flow: which tasks a run names (bundled, a user's folder,
the harness's own), their refusal before training when they cannot run offline, the scores' MLflow names,
the base/trained table, and the cache that keeps a retried run from scoring again."""
from __future__ import annotations

import json

import pytest

from tiny_models import save_tiny_model
from twinkle_core.evaluate import harness
from twinkle_core.evaluate.benchmarks import (BenchmarkError, benchmark_metrics, champion_value, plan_benchmarks,
                                              summary_table)

RESULTS = {"results": {"twinkle_arithmetic": {"alias": "twinkle_arithmetic", "exact_match,first-number": 0.25,
                                              "exact_match_stderr,first-number": 0.1},
                       "twinkle_corpus": {"word_perplexity,none": 40.0, "word_perplexity_stderr,none": "N/A",
                                                "acc,none": 0.5, "acc_stderr,none": 0.2}},
           "higher_is_better": {"twinkle_corpus": {"word_perplexity": False, "acc": True},
                                "twinkle_arithmetic": {"exact_match": True}}}


def test_the_bundled_tasks_plan_with_the_chat_template_where_they_say():
    plan = plan_benchmarks(["twinkle"])
    assert plan.tasks == ["twinkle_arithmetic", "twinkle_corpus", "twinkle_self_cognition"]
    assert plan.chat == {"twinkle_arithmetic": True, "twinkle_corpus": False, "twinkle_self_cognition": True}
    assert not plan.include_defaults  # the harness's own index (~15 s) is not built for bundled tasks
    assert plan.higher_is_better["twinkle_corpus"] == {"word_perplexity": False, "byte_perplexity": False,
                                                        "bits_per_byte": False}
    assert plan_benchmarks(["twinkle_arithmetic"], chat_template="no").chat == {"twinkle_arithmetic": False}
    assert plan_benchmarks(["twinkle_arithmetic"], has_chat_template=False).chat == {"twinkle_arithmetic": False}


def test_a_task_that_cannot_run_offline_is_refused_with_where_the_harness_looked(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    with pytest.raises(BenchmarkError, match=r"eval task 'twinkle_arithmetc' is unknown to lm-evaluation-harness; "
                                             r"did you mean twinkle_arithmetic"):
        plan_benchmarks(["twinkle_arithmetc"])
    with pytest.raises(BenchmarkError) as raised:
        plan_benchmarks(["hellaswag"])
    message = str(raised.value)
    assert message.startswith("eval task 'hellaswag' cannot run offline: ") and str(tmp_path / "datasets") in message
    with pytest.raises(BenchmarkError, match="eval task folder './nowhere/' does not exist"):
        plan_benchmarks(["./nowhere/"])


def _user_tasks(folder):
    folder.mkdir()
    (folder / "capitals.jsonl").write_text("".join(json.dumps({"q": f"Capital number {i}?", "a": "Paris"}) + "\n"
                                                   for i in range(5)))
    (folder / "capitals.yaml").write_text(
        "task: my_capitals\ndataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {folder / 'capitals.jsonl'}\n"
        "output_type: loglikelihood\ntest_split: test\ndoc_to_text: '{{q}}'\ndoc_to_target: ' {{a}}'\n"
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n")


def test_a_users_task_folder_is_planned_and_scored_like_a_bundled_task(tmp_path, monkeypatch):
    monkeypatch.setenv("TWINKLE_CACHE", str(tmp_path / "cache"))
    _user_tasks(tmp_path / "my_tasks")
    plan = plan_benchmarks([str(tmp_path / "my_tasks"), "twinkle_corpus"])
    assert plan.tasks == ["twinkle_corpus", "my_capitals"] and plan.chat["my_capitals"] is False
    model = save_tiny_model(tmp_path / "tiny", "llama")
    config = harness.BenchmarkRunConfig(family="llama3", model_path=model, model_hash="tiny", checkpoints={"base": None},
                                        plan=plan, result_path=tmp_path / "out.json", mixed_precision="no", limit=3)
    results = harness.score_cached(config, "base", None)
    metrics = benchmark_metrics(results)
    assert set(metrics) >= {"bench/my_capitals/acc", "bench/twinkle_corpus/word_perplexity"}
    assert results["n-samples"]["my_capitals"]["effective"] == 3
    # The same model, tasks and settings again: from the cache, without loading a model.
    monkeypatch.setattr(harness, "harness_model", lambda *_: pytest.fail("scored again"))
    assert harness.score_cached(config, "base", None) == results
    changed = config.model_copy(update={"limit": 2})
    with pytest.raises(pytest.fail.Exception, match="scored again"):
        harness.score_cached(changed, "base", None)  # another setting is another key


def test_scores_are_named_for_mlflow_and_tabled_base_against_trained():
    metrics = benchmark_metrics(RESULTS)
    assert metrics == {"bench/twinkle_arithmetic/exact_match.first-number": 0.25,
                       "bench/twinkle_arithmetic/exact_match.first-number_stderr": 0.1,
                       "bench/twinkle_corpus/word_perplexity": 40.0, "bench/twinkle_corpus/acc": 0.5,
                       "bench/twinkle_corpus/acc_stderr": 0.2}  # "N/A" stderr is left out
    assert set(benchmark_metrics(RESULTS, "base_bench")) == {name.replace("bench/", "base_bench/", 1) for name in metrics}
    trained = json.loads(json.dumps(RESULTS))
    trained["results"]["twinkle_corpus"]["acc,none"] = 0.75
    table = summary_table({"base": RESULTS, "trained": trained}).splitlines()
    assert table[0] == "| task | measure | base | trained | change |"
    assert "| twinkle_corpus | acc | 0.5 ± 0.2 | 0.75 ± 0.2 | +0.25 |" in table
    assert "| twinkle_arithmetic | exact_match.first-number | 0.25 ± 0.1 | 0.25 ± 0.1 | +0 |" in table
    assert champion_value(trained, "bench/twinkle_corpus/word_perplexity") == (40.0, False)
    assert champion_value(trained, "bench/twinkle_arithmetic/exact_match.first-number") == (0.25, True)
    with pytest.raises(BenchmarkError, match="is not among the benchmark scores"):
        champion_value(trained, "bench/twinkle_corpus/bleu")


def test_embedding_and_vision_language_runs_refuse_benchmarks_with_the_reason():
    from flows.cli import parse_config
    from flows.embedding import EmbeddingConfig
    from flows.sft import SFTConfig

    with pytest.raises(SystemExit, match="eval_tasks: an embedding model is scored by retrieval recall"):
        parse_config(EmbeddingConfig, ["--eval-tasks", "twinkle"], "d")
    with pytest.raises(SystemExit, match="eval_tasks: benchmarks score text-only language models for now"):
        parse_config(SFTConfig, ["--model-id", "hf://Qwen/Qwen2.5-VL-3B-Instruct", "--eval-tasks", "twinkle"], "d")
    with pytest.raises(SystemExit, match="champion_metric='bench/twinkle_arithmetic/acc' needs eval_tasks"):
        parse_config(SFTConfig, ["--champion-metric", "bench/twinkle_arithmetic/acc"], "d")
    config = parse_config(SFTConfig, ["--eval-tasks", "twinkle,./my_tasks/", "--eval-limit", "5"], "d")
    assert config.eval_tasks == ["twinkle", "./my_tasks/"] and config.benchmark_settings()["limit"] == 5
