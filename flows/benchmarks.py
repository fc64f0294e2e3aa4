"""What the sft, dpo and grpo flows do with --eval-tasks: check the tasks before training, score base and
trained after it, let a benchmark score decide the champion, and add the table to the run summary."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from tasks.benchmark import benchmark, check_benchmarks
from tasks.refs import CheckpointRef, ModelRef
from twinkle_core.evaluate.benchmarks import BenchmarkPlan, champion_value


def plan_benchmarks(config: Any, model: ModelRef) -> BenchmarkPlan | None:
    """The checked tasks (their data loaded offline), or None when the run asked for none."""
    return check_benchmarks(list(config.eval_tasks), config.eval_chat_template, model) if config.eval_tasks else None


def run_benchmarks(config: Any, plan: BenchmarkPlan | None, model: ModelRef, checkpoint: CheckpointRef,
                   run_dir: Path, run_id: str) -> dict | None:
    if plan is None:
        return None
    return benchmark(model, checkpoint.path, plan, config.benchmark_settings(), str(run_dir), config.mixed_precision,
                     run_id, config.timeout_minutes * 60)


def champion_metric(config: Any, bench: dict | None, value: float, metric: str, higher_is_better: bool
                    ) -> dict[str, Any]:
    """register()'s metric arguments: the flow's own held-out metric, or the benchmark score the user named."""
    if config.champion_metric and bench is not None:
        value, higher_is_better = champion_value(bench["trained"], config.champion_metric)
        metric = config.champion_metric
    return {"eval_loss": value, "metric": metric, "higher_is_better": higher_is_better}


def with_benchmarks(summary: str, bench: dict | None) -> str:
    if bench is None:
        return summary
    return f"{summary}\n\n### Benchmarks (lm-evaluation-harness)\n\n{bench['table']}\n"
