"""Benchmarks in the evaluate step: the tasks checked offline before training, then the base and trained
models scored by lm-evaluation-harness in a worker process, the scores logged to MLflow."""
from __future__ import annotations

from pathlib import Path

from mlflow import MlflowClient
from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact

from tasks.eval_worker import run_eval_worker
from tasks.refs import ModelRef
from twinkle_core.evaluate.benchmarks import BenchmarkPlan, benchmark_metrics, plan_benchmarks, summary_table
from twinkle_core.tracking import tracking_uri
from twinkle_core.train.checks import has_chat_template


@task
def check_benchmarks(tasks: list[str], chat_template: str, model: ModelRef) -> BenchmarkPlan:
    """Every task found and its data loaded offline now, so a task that cannot run fails before training."""
    plan = plan_benchmarks(tasks, chat_template, has_chat_template(model))
    get_run_logger().info("benchmarks: %s (chat template on %s)", ", ".join(plan.tasks),
                          ", ".join(t for t in plan.tasks if plan.chat[t]) or "none")
    return plan


@task
def benchmark(model: ModelRef, checkpoint: str | None, plan: BenchmarkPlan, settings: dict, run_dir: str,
              mixed_precision: str, mlflow_run_id: str | None = None, timeout_s: float | None = None,
              tokenizer_path: str | None = None, with_base: bool = True) -> dict:
    """Scores of the base and, given a checkpoint folder (an adapter or a whole model), of the trained model:
    {"base": results, "trained": results, "table": markdown}. Metrics go to the MLflow run as bench/TASK/MEASURE
    (trained) and base_bench/... (base), the harness's own results JSON as artifacts under benchmarks/."""
    from twinkle_core.evaluate.harness import BenchmarkRunConfig

    run_dir = Path(run_dir)
    checkpoints = ({"base": None} if with_base else {}) | ({"trained": Path(checkpoint)} if checkpoint else {})
    config = BenchmarkRunConfig(
        model_path=Path(model.path), model_hash=model.content_hash, **model.ref_options(), checkpoints=checkpoints,
        plan=plan, mixed_precision=mixed_precision, result_path=run_dir / "benchmarks.json",
        tokenizer_path=tokenizer_path, **settings)
    reports = run_eval_worker("twinkle_core.evaluate.harness", config, run_dir / "benchmarks_config.json", timeout_s)
    table = summary_table(reports)
    log_benchmarks(mlflow_run_id, reports, table)
    create_markdown_artifact(table, key="benchmarks", description="lm-evaluation-harness scores, base vs trained")
    get_run_logger().info("benchmarks:\n%s", table)
    return {**reports, "table": table}


def log_benchmarks(mlflow_run_id: str | None, reports: dict[str, dict], table: str) -> None:
    """Each model's scores as metrics (base_bench/... for the base), the harness's results JSON and the table."""
    if not mlflow_run_id:
        return
    client = MlflowClient(tracking_uri())
    for label, results in reports.items():
        prefix = "bench" if label == "trained" else f"{label}_bench"
        for name, value in benchmark_metrics(results, prefix).items():
            client.log_metric(mlflow_run_id, name, value)
        client.log_dict(mlflow_run_id, results, f"benchmarks/results_{label}.json")
    client.log_text(mlflow_run_id, table, "benchmarks/summary.md")
