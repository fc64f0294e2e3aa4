"""Benchmark a registered model version with lm-evaluation-harness, beside its base model.

    python -m flows.evaluate --model models:/NAME@champion --tasks twinkle            # the bundled tasks
    python -m flows.evaluate --model models:/NAME/3 --tasks arc_easy,hellaswag --limit 200   # data in the HF cache
    python -m flows.evaluate --model models:/NAME@candidate --tasks ./my_tasks/      # a folder of YAML tasks

The scores go on the version: MLflow metrics of the run that made it (bench/TASK/MEASURE, base_bench/... for
the base) and tags on the version itself, with the harness's results JSON and the table as artifacts.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, ClassVar

from mlflow import MlflowClient
from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from pydantic import BaseModel, Field, field_validator, model_validator

from flows.cli import run_from_cli
from flows.run_folder import discard_bare_run_folder, run_folder
from tasks.benchmark import benchmark, check_benchmarks
from tasks.refs import ModelRef
from twinkle_core.config.fields import (EvalBatchSize, EvalChatTemplate, EvalGenKwargs, EvalLimit, EvalNumFewshot,
                                        EvalTasks, MixedPrecisionMode, OutputDir, TimeoutMinutes, comma_list)
from twinkle_core.evaluate.benchmarks import benchmark_metrics
from twinkle_core.tracking import tracking_uri

RegisteredModelUri = Annotated[str, Field(description="The version to score: models:/NAME@ALIAS or "
                                                      "models:/NAME/VERSION.")]


class EvaluateConfig(BaseModel):
    """Parameters of the evaluate flow."""

    kind: ClassVar[str] = "evaluate"
    resumable: ClassVar[bool] = False

    model: RegisteredModelUri
    tasks: EvalTasks = ["twinkle"]
    limit: EvalLimit = None
    num_fewshot: EvalNumFewshot = None
    batch_size: EvalBatchSize = 8
    gen_kwargs: EvalGenKwargs = {}
    chat_template: EvalChatTemplate = "auto"
    with_base: bool = Field(True, description="Score an adapter version's base model too, for the base/trained "
                                              "table (a merged or fully trained version is scored alone).")
    mixed_precision: MixedPrecisionMode = "auto"
    output_dir: OutputDir = "runs"
    timeout_minutes: TimeoutMinutes = 120

    _one_task_is_a_list = field_validator("tasks", mode="before")(comma_list)

    @model_validator(mode="after")
    def _check_uri(self):
        from twinkle_core.tracking.registered import parse_model_uri

        parse_model_uri(self.model)  # a malformed URI is refused with the options, before any server starts
        if not self.tasks:
            raise ValueError("tasks: name at least one benchmark task (e.g. twinkle)")
        return self


@task
def fetch_version(uri: str, folder: str) -> dict:
    """The version's model files in `folder`: {name, version, run_id, model (the base, as a ModelRef),
    checkpoint (the adapter or whole model), tokenizer (the folder with the run's tokenizer and template)}."""
    from twinkle_core.families.registry import family_for_model_dir
    from twinkle_core.hashing import hash_tree
    from twinkle_core.tracking import chat_model
    from twinkle_core.tracking.registered import download_version, find_version, parse_model_uri

    version = find_version(*parse_model_uri(uri))
    model_dir, flavor = download_version(version, folder)
    if chat_model.is_vision_checkpoint(model_dir):
        from twinkle_core.evaluate.benchmarks import BenchmarkError

        raise BenchmarkError(f"{uri} is a vision-language model: benchmarks score text-only language models for now")
    adapter = chat_model.is_adapter(model_dir)
    # An adapter's base comes with it; a merged or fully trained version is scored alone (its base may be gone).
    base_dir = Path(chat_model.fetch_base(flavor)) if adapter else model_dir
    base = ModelRef(model_id=flavor.get("base_model_id") or uri, path=str(base_dir),
                    content_hash=flavor.get("base_content_hash") if adapter else hash_tree(base_dir),
                    family=family_for_model_dir(base_dir).name)
    return {"name": version.name, "version": str(version.version), "run_id": version.run_id, "model": base,
            "checkpoint": str(model_dir), "adapter": adapter, "tokenizer": str(model_dir)}


def _attach(found: dict, reports: dict) -> None:
    """The trained scores as tags on the version (the run that made it has them as metrics)."""
    client = MlflowClient(tracking_uri())
    for name, value in benchmark_metrics(reports["trained"]).items():
        client.set_model_version_tag(found["name"], found["version"], name, f"{value:.6g}")


@flow(name="evaluate", on_failure=[discard_bare_run_folder])
def evaluate_registered(config: EvaluateConfig) -> dict:
    """Score a registered version (and its base) on `config.tasks`; attach the scores to the version."""
    run_dir = run_folder(config.output_dir, config)
    found = fetch_version(config.model, str(run_dir / "model"))
    base: ModelRef = found["model"]
    plan = check_benchmarks(list(config.tasks), config.chat_template, base)
    settings = {"limit": config.limit, "num_fewshot": config.num_fewshot, "batch_size": config.batch_size,
                "gen_kwargs": dict(config.gen_kwargs)}
    reports = benchmark(base, found["checkpoint"], plan, settings, str(run_dir), config.mixed_precision,
                        found["run_id"], config.timeout_minutes * 60, tokenizer_path=found["tokenizer"],
                        with_base=config.with_base and found["adapter"])
    _attach(found, reports)
    summary = "\n".join([f"## Twinkle Flows: benchmarks of {found['name']} version {found['version']}", "",
                         f"model: {config.model} (base: {base.model_id})", f"tasks: {', '.join(plan.tasks)}"
                         + (f", {config.limit} examples each" if config.limit else ""), "", reports["table"], "",
                         f"MLflow run id: {found['run_id']} (metrics bench/..., and tags on version "
                         f"{found['version']})"])
    create_markdown_artifact(summary, key="evaluate-summary", description="benchmarks of a registered version")
    get_run_logger().info("run summary:\n%s", summary)
    return {"summary": summary, "reports": reports, "version": found["version"], "run_id": found["run_id"]}


def main(argv: list[str] | None = None) -> int:
    return run_from_cli(evaluate_registered, EvaluateConfig, argv, __doc__)


if __name__ == "__main__":
    sys.exit(main())
