"""Embedding models trained with InfoNCE: download → tokenize → train → evaluate → register.

    python -m flows.embedding                # the embedded default: all-MiniLM-L6-v2 on the bundled retrieval set
    python -m flows.embedding --model-id hf://Qwen/Qwen3-Embedding-0.6B --query-task "Given a question, ..."
    python -m flows.embedding --nproc-per-node 2 --dp-size 2    # DDP; negatives gathered over both processes
    python -m flows.embedding --help         # every option

Rows are {"query", "positive", "negatives"} (also sentence-transformers' anchor/positive/negative and
ms-swift's messages/positive_messages/negative_messages). Each query is contrasted with every document of
the global micro-batch; the registered version is a sentence-transformers directory.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import ClassVar

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact

from flows.cli import run_from_cli
from flows.params import TrainingFlowConfig, default_model_name
from flows.run_folder import discard_bare_run_folder, run_folder
from flows.tracked import TrackedRun
from flows.summary import family_line, handed_off, registry_lines
from tasks.download import download_dataset, download_model
from tasks.evaluate_retrieval import evaluate_retrieval, metric_key
from tasks.refs import ModelRef
from tasks.register import register
from tasks.tokenize import tokenize
from tasks.train import train
from twinkle_core.config.fields import (AdapterFields, BackendFields, BenchmarkFields, CheckpointFields,
                                        DataParallelFields, DatasetId,
                                        BatchSize, DataSourceFields, EmbeddingDataFields, EmbeddingFields, EvalDatasetId,
                                        ExperimentName, LearningRate, LoopFields, MachinesFields, ModelId,
                                        ModelParallelFields, OptimizerFields, ProcessFields, RegisteredModelName,
                                        RunFields)
from twinkle_core.embedding.settings import EmbeddingSettings, resolve_settings
from twinkle_core.evaluate.retrieval import METRICS
from twinkle_core.families import get_family
from twinkle_core.objectives.embedding import EXPORT_NAME
from twinkle_core.tracking import tracking_uri
from twinkle_core.train import TrainRunConfig

DEFAULT_MODEL = "pkg://all_minilm_l6_v2/model.zip"
DEFAULT_DATASET = "pkg://twinkle_core/datasets/retrieval/train.jsonl"
DEFAULT_EVAL_DATASET = "pkg://twinkle_core/datasets/retrieval/heldout.jsonl"
CHAMPION_METRIC = "recall@1"  # a new version becomes champion when its held-out recall@1 is higher


class EmbeddingConfig(RunFields, BenchmarkFields, ModelParallelFields, DataParallelFields, MachinesFields,
                      ProcessFields, OptimizerFields, LoopFields, CheckpointFields, AdapterFields, EmbeddingFields,
                      EmbeddingDataFields, BackendFields, DataSourceFields, TrainingFlowConfig):
    """Parameters of the embedding flow (the Prefect UI form and the CLI options; groups listed last-first)."""

    kind: ClassVar[str] = "embedding"
    objective: ClassVar[str] = "infonce"
    benchmarks_refused: ClassVar[str] = ("an embedding model is scored by retrieval recall on the held-out pairs; "
                                         "MTEB would be its benchmark harness, which this project does not run yet")

    model_id: ModelId = DEFAULT_MODEL
    dataset: DatasetId = DEFAULT_DATASET
    eval_dataset: EvalDatasetId = DEFAULT_EVAL_DATASET
    lr: LearningRate = 2e-3
    batch_size: BatchSize = 32  # in-batch negatives: the larger the batch, the more of them
    registered_model_name: RegisteredModelName = None
    experiment_name: ExperimentName = "twinkle-embedding"

    def model_name(self) -> str:
        return self.registered_model_name or default_model_name(self.model_id)

    def run_config(self, model: ModelRef, train_data: str, checkpoint_dir: Path, run_id: str,
                   settings: EmbeddingSettings) -> TrainRunConfig:
        options = {**self.objective_options(), **settings.as_dict()}  # pooling and prompt as tokenised
        options.pop("query_task", None)
        given = dict(model_path=model.path, **model.ref_options(), train_data=train_data, checkpoint_dir=checkpoint_dir,
                     parallel=self.parallel(), objective=self.objective, objective_options=options,
                     mlflow_run_id=run_id, tracking_uri=tracking_uri())
        shared = (set(TrainRunConfig.model_fields) & set(EmbeddingConfig.model_fields)) - set(given)
        return TrainRunConfig(**self.model_dump(include=shared), **given)


def render_embedding_summary(config: EmbeddingConfig, reports: dict, registration: dict, run_id: str, checkpoint,
                             train_data, settings: EmbeddingSettings, family: str, links: dict[str, str]) -> str:
    base, trained = reports["base"], reports["trained"]
    lines = [
        "## Twinkle Flows: embedding summary", "",
        f"model: {config.model_id}", family_line(family),
        f"dataset: {config.dataset} ({train_data.num_rows} pairs, {train_data.num_tokens} tokens, "
        f"{train_data.num_bad} bad rows skipped)",
        f"settings: {settings.pooling} pooling, temperature {config.temperature:g}, "
        f"{'same-side negatives, ' if config.same_side_negatives else ''}lr {config.lr:g}, batch {config.batch_size}, "
        f"{config.nproc_per_node * config.nnodes} process(es)",
        f"training: {'LoRA r=' + str(config.lora_r) + ' (merged)' if config.use_lora else 'full'}, "
        f"{checkpoint.train_seconds:.0f} s, final loss {checkpoint.final_metrics.get('loss', float('nan')):.4f}, "
        f"{checkpoint.final_metrics.get('tokens_per_s', 0):.0f} tokens/s",
        f"held-out: {trained['queries']} queries against {trained['corpus']} passages", "",
        f"base recall@1: {base['recall@1']:.4f}",
        f"trained recall@1: {trained['recall@1']:.4f}", "",
        "| | " + " | ".join(METRICS) + " |", "|---|" + "---|" * len(METRICS),
        *(f"| {label} | " + " | ".join(f"{report[m]:.4f}" for m in METRICS) + " |"
          for label, report in reports.items()), "",
    ]
    return "\n".join(lines + registry_lines(run_id, registration, checkpoint, links,
                                            ", a sentence-transformers directory"))


@flow(name="embedding", on_failure=[discard_bare_run_folder])
def embedding(config: EmbeddingConfig = EmbeddingConfig()) -> dict:
    """Train `config.model_id` as an embedding model on `config.dataset` and register it in MLflow."""
    run_dir = run_folder(config.output_dir, config)  # a retry of this flow run gets the same folder and resumes
    model = download_model(config.model_id, **config.model_options())
    config.check_model(model)
    # The pooling and query prompt: the run's choice, else the checkpoint's files, else the family's.
    settings = resolve_settings(model.path, get_family(model.family), config.pooling, config.query_task)
    train_file = download_dataset(config.dataset, config.streaming)  # the held-out set is small: a file
    eval_file = download_dataset(config.eval_dataset)
    train_data = tokenize(train_file, model, config.max_length, False, config.max_bad_fraction, True, "pairs",
                          settings.encode_options(), num_proc=config.num_proc)
    with TrackedRun(config, run_dir, "embedding") as tracked:
        run_config = config.run_config(model, train_data.path, run_dir / "checkpoints", tracked.run_id, settings)
        checkpoint = train(run_config, str(run_dir), timeout_s=config.timeout_minutes * 60,
                           device_limit=config.device_limit)
        if checkpoint is None:  # a multi-machine run: the machine with global rank 0 evaluates and registers
            return handed_off(tracked.run_id, model.family)
        reports = evaluate_retrieval(model, checkpoint, eval_file, settings, str(run_dir), config.max_length,
                                     config.max_bad_fraction, tracked.run_id, config.timeout_minutes * 60)
        adapter = Path(checkpoint.path).parent / run_config.adapter_name
        extras = {"adapter": str(adapter)} if config.use_lora else {}
        registration = register(checkpoint, config.model_name(), tracked.run_id, reports["trained"][CHAMPION_METRIC],
                                tracked.tags, metric="eval_" + metric_key(CHAMPION_METRIC),
                                higher_is_better=True, extras=extras, base=model, dataset=train_file)
    run_id, links = tracked.run_id, tracked.links
    summary = render_embedding_summary(config, reports, registration, run_id, checkpoint, train_data, settings,
                                       model.family, links)
    create_markdown_artifact(summary, key="embedding-summary", description="base vs trained embedding model")
    get_run_logger().info("run summary:\n%s", summary)
    return {"summary": summary, "run_id": run_id, "registration": registration, "reports": reports,
            "checkpoint": checkpoint.path, "probe_loss": checkpoint.probe_loss, "train_data": train_data.path,
            "family": model.family, "settings": settings.as_dict(), "export_name": EXPORT_NAME}


def main(argv: list[str] | None = None) -> int:
    return run_from_cli(embedding, EmbeddingConfig, argv, __doc__)


if __name__ == "__main__":
    sys.exit(main())
