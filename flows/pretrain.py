"""Continued pre-training on megatron-core: download → pack → convert → train → convert back → evaluate → register.

    python -m flows.pretrain                          # the default model on the bundled corpus, on CPU
    python -m flows.pretrain --nproc-per-node 2 --tp-size 2 --dataset corpus.jsonl --seq-length 1024
    python -m flows.pretrain --dataset "0.7 web_text_document 0.3 code.jsonl"   # a blend; PREFIX = PREFIX.bin/.idx
    python -m flows.pretrain --help                   # every option
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import ClassVar

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact
from pydantic import BaseModel, field_validator

from flows.cli import run_from_cli
from flows.params import TrainingFlowConfig, default_model_name
from flows.run_folder import discard_bare_run_folder, run_folder
from tasks.convert import convert, open_megatron_checkpoint, to_hf
from tasks.download import download_corpus, download_model, indexed_prefix
from tasks.evaluate_lm import evaluate_lm
from tasks.pack import blend, pack
from tasks.refs import CheckpointRef, DatasetRef, ModelRef, PackedRef
from tasks.register import register
from tasks.track import finish_tracking, log_loss_curve, prefect_tags, start_tracking
from tasks.train import train
from twinkle_core.config.fields import (CheckpointEvery, DatasetId, DocumentMasks, EvalBatches, ExperimentName,
                                        GlobalBatchSize, LearningRate, MachinesFields, MaxBadFraction, MaxSteps,
                                        MicroBatchSize, MixedPrecisionMode, ModelParallelFields, NumProc,
                                        OptimizerFields, ProcessFields, RegisteredModelName, RunFields, SeqLength,
                                        ValidationFraction, VirtualPipelineStages, WarmupRatio, WeightDecay)
from twinkle_core.data.blend import parse_data_path
from twinkle_core.hub import HubError, dataset_problems
from twinkle_core.tracking import tracking_uri
from twinkle_core.train.pretrain import PretrainRunConfig

DEFAULT_CORPUS = "pkg://twinkle_core/datasets/pretrain/corpus.jsonl"


class CorpusFields(BaseModel):
    """The corpus ({"text": ...} rows, a Megatron-LM .bin/.idx prefix, or a weighted blend) and how it is packed."""

    dataset: DatasetId = DEFAULT_CORPUS
    seq_length: SeqLength = 64
    validation_fraction: ValidationFraction = 0.2
    document_masks: DocumentMasks = True
    max_bad_fraction: MaxBadFraction = 0.01
    num_proc: NumProc = None

    @field_validator("dataset")
    @classmethod
    def _check_blend(cls, dataset: str) -> str:
        parse_data_path(dataset)  # a malformed blend fails before any task runs
        return dataset

    def dataset_problems(self) -> list[str]:
        """Each corpus of the blend (or the one corpus) exists: a Megatron prefix, or an id download resolves."""
        problems = []
        for _, dataset_id in parse_data_path(self.dataset):
            try:
                if indexed_prefix(dataset_id) is None:
                    problems += dataset_problems("dataset", dataset_id)
            except HubError as error:
                problems.append(f"dataset={self.dataset!r}: {error}")
        return problems


class PretrainConfig(RunFields, ModelParallelFields, MachinesFields, ProcessFields, OptimizerFields, CorpusFields,
                     TrainingFlowConfig):
    """Parameters of the pretrain flow (the Prefect UI form and the CLI options; groups listed last-first)."""

    kind: ClassVar[str] = "pretrain"
    backend: ClassVar[str] = "megatron"

    mixed_precision: MixedPrecisionMode = "auto"
    max_steps: MaxSteps = 8
    global_batch_size: GlobalBatchSize = 8
    micro_batch_size: MicroBatchSize = 2
    lr: LearningRate = 5e-5
    weight_decay: WeightDecay = 0.01
    warmup_ratio: WarmupRatio = 0.1
    eval_batches: EvalBatches = 4
    checkpoint_every: CheckpointEvery = 10
    virtual_pipeline_stages: VirtualPipelineStages = None
    registered_model_name: RegisteredModelName = None
    experiment_name: ExperimentName = "twinkle-pretrain"

    def problems(self, model_config) -> list[str]:
        dp, rows = self.data_parallel_size(), self.micro_batch_size
        fits = dp * rows * max(1, self.global_batch_size // (dp * rows))
        return [problem for bad, problem in (
            (self.max_steps is None, "max_steps=None: pre-training runs a given number of steps; set max_steps"),
            (self.global_batch_size % (dp * rows),
             f"global_batch_size={self.global_batch_size} must be a multiple of data-parallel size {dp} x "
             f"micro_batch_size={rows}; e.g. global_batch_size={fits}"),
        ) if bad]

    def data_parallel_size(self) -> int:
        """The processes that tp × pp × cp leave: each trains on its share of every global batch (context-
        parallel ranks share their rows, each holding a part of every sequence)."""
        return max(1, self.world_size() // (self.tp_size * self.pp_size * self.cp_size))

    def model_name(self) -> str:
        return self.registered_model_name or default_model_name(self.model_id, "pretrain-")

    def run_config(self, model: ModelRef, data: PackedRef, checkpoint_dir: Path, run_id: str) -> PretrainRunConfig:
        given = dict(model_path=model.path, **model.ref_options(), data_dir=data.path, checkpoint_dir=checkpoint_dir,
                     parallel=self.parallel(), mlflow_run_id=run_id, tracking_uri=tracking_uri())
        shared = (set(PretrainRunConfig.model_fields) & set(PretrainConfig.model_fields)) - set(given)
        return PretrainRunConfig(**self.model_dump(include=shared), **given)


@flow(name="pretrain", on_failure=[discard_bare_run_folder])
def pretrain(config: PretrainConfig = PretrainConfig()) -> dict:
    """Continue pre-training `config.model_id` on `config.dataset` with megatron-core and register the result."""
    run_dir = run_folder(config.output_dir, config)
    timeout_s = config.timeout_minutes * 60
    model = download_model(config.model_id, **config.model_options())
    config.check_model(model)  # model-dependent rules (tp_size vs the heads, MoE under tp) before the rest
    dataset, data = _corpus(config, model)
    megatron_model = convert(model, "megatron", config.tp_size, config.pp_size, timeout_s)
    tags = prefect_tags("pretrain")
    run_id = start_tracking(config.experiment_name, run_dir.name, config.model_dump(mode="json"),
                            {**tags, "model_id": config.model_id})
    try:
        checkpoint = train(config.run_config(megatron_model, data, run_dir / "checkpoints", run_id), str(run_dir),
                           timeout_s=timeout_s, device_limit=config.device_limit, entry="twinkle_core.train.pretrain")
        if checkpoint is None:
            finish_tracking(run_id)
            return {"summary": "training finished; the machine that held global rank 0 converts and registers",
                    "run_id": run_id}
        exported = to_hf(open_megatron_checkpoint(checkpoint.path), config.tp_size, config.pp_size, timeout_s)
        rows = config.data_parallel_size() * config.micro_batch_size  # the trainer's validation batch
        report = evaluate_lm(exported, data, rows, config.eval_batches,
                             config.seed, config.document_masks, run_id)
        hf_checkpoint = CheckpointRef(path=exported.path, is_adapter=False, final_metrics=checkpoint.final_metrics,
                                      train_seconds=checkpoint.train_seconds, probe_loss=report["loss"])
        registration = register(hf_checkpoint, config.model_name(), run_id, report["loss"], tags, base=model,
                                dataset=dataset)
        log_loss_curve(run_id)
    except BaseException:
        finish_tracking(run_id, "FAILED")
        raise
    finish_tracking(run_id)
    summary = _summary(config, checkpoint, report, registration, data)
    create_markdown_artifact(summary, key="pretrain-summary", description="continued pre-training")
    get_run_logger().info("run summary:\n%s", summary)
    return {"summary": summary, "run_id": run_id, "registration": registration, "report": report,
            "megatron_checkpoint": checkpoint.path, "hf_checkpoint": exported.path,
            "metrics": checkpoint.final_metrics}


def _corpus(config: PretrainConfig, model: ModelRef) -> tuple[DatasetRef, PackedRef]:
    """Download and pack each corpus of `config.dataset`; a blend of several is blended (and registered as
    one data set: the blend text, keyed by the blend's content)."""
    parts = parse_data_path(config.dataset)
    datasets = [download_corpus(dataset_id) for _, dataset_id in parts]
    packed = [pack(dataset, model, config.seq_length, config.validation_fraction, config.seed,
                   config.max_bad_fraction, config.num_proc) for dataset in datasets]
    if len(parts) == 1:
        return datasets[0], packed[0]
    data = blend(packed, [weight for weight, _ in parts], [dataset_id for _, dataset_id in parts])
    return DatasetRef(dataset_id=config.dataset, path=data.path, content_hash=data.content_hash), data


def _summary(config: PretrainConfig, checkpoint: CheckpointRef, report: dict, registration: dict,
             data: PackedRef) -> str:
    m = checkpoint.final_metrics
    layout = f"tp {config.tp_size} × pp {config.pp_size} × ep {config.ep_size}" + (
        " + sequence parallel" if config.sequence_parallel else "")
    blend = [f"  - {part.weight:.3g} × `{part.dataset_id}`: {part.train_sequences} training and "
             f"{part.validation_sequences} validation sequences" for part in data.blend]
    return "\n".join([
        "## Twinkle Flows: pre-training summary", "",
        f"- model: `{config.model_id}`, corpus `{config.dataset}`: {data.train_sequences} training and "
        f"{data.validation_sequences} validation sequences of {config.seq_length} tokens"
        + (f", a blend of {len(blend)} corpora:" if blend else ""), *blend,
        f"- {config.max_steps} steps of {config.global_batch_size} sequences on megatron-core, "
        f"{config.world_size()} process(es), {layout}, {checkpoint.train_seconds:.1f} s",
        f"- last step: loss {m.get('loss', float('nan')):.4f}, {m.get('tokens_per_s_total', 0):.0f} tokens/s, "
        f"MFU {100 * m.get('mfu', 0):.1f}%, peak memory {m.get('peak_memory_mb', 0):.0f} MB", "",
        "| validation loss | Megatron (base) | Megatron (trained) | exported HF model |",
        "|---|---|---|---|",
        f"| | {m.get('eval_base_loss', float('nan')):.4f} | {m.get('eval_trained_loss', float('nan')):.4f} | "
        f"{report['loss']:.4f} |", "",
        f"Registered `{registration['name']}` version {registration['version']}: {registration['decision']}",
    ])


def main(argv: list[str] | None = None) -> int:
    return run_from_cli(pretrain, PretrainConfig, argv, __doc__)


if __name__ == "__main__":
    sys.exit(main())
