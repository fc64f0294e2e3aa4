"""Supervised fine-tuning: download → tokenize → convert → train → evaluate → register.

    python -m flows.sft                      # the embedded default: SmolLM2-135M-Instruct learns it is Twinkle
    python -m flows.sft --backend megatron --nproc-per-node 2 --tp-size 2    # on megatron-core
    python -m flows.sft --help               # every option
    python -m flows.sft --config run.yaml --lr 1e-4
    python -m flows.sft --model-id ms://Qwen/Qwen2.5-VL-7B-Instruct --dataset chats_with_images.jsonl   # a VLM
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import ClassVar

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact

from flows.benchmarks import champion_metric, plan_benchmarks, run_benchmarks, with_benchmarks
from flows.cli import run_from_cli
from flows.params import TrainingFlowConfig, default_model_name
from flows.run_folder import discard_bare_run_folder, run_folder
from flows.summary import handed_off, render_summary
from flows.tracked import TrackedRun
from tasks.convert import convert
from tasks.download import download_dataset, download_model
from tasks.evaluate import evaluate
from tasks.prompts import sample_prompts
from tasks.refs import ModelRef
from tasks.register import register
from tasks.tokenize import tokenize
from tasks.train import train
from twinkle_core.config.fields import (AdapterFields, BackendFields, BatchingFields, BenchmarkFields, CheckpointFields,
                                        DataParallelFields, DatasetId, DataSourceFields, EvalDatasetId, EvalFields,
                                        ExperimentName, LoopFields, MachinesFields, ModelParallelFields,
                                        OptimizerFields, PackedChatDataFields, ProcessFields, RegisteredModelName,
                                        RouterAuxLossCoef, RunFields, VisionFields)
from twinkle_core.data import get_row_format
from twinkle_core.families import family_before_download
from twinkle_core.objectives import get_objective
from twinkle_core.tracking import tracking_uri
from twinkle_core.train import TrainRunConfig

DEFAULT_DATASET = "pkg://twinkle_core/datasets/self_cognition/train.jsonl"
DEFAULT_EVAL_DATASET = "pkg://twinkle_core/datasets/self_cognition/heldout.jsonl"


class SFTConfig(RunFields, BenchmarkFields, EvalFields, ModelParallelFields, DataParallelFields, MachinesFields,
                ProcessFields,
                OptimizerFields, BatchingFields, LoopFields, CheckpointFields, AdapterFields, VisionFields,
                PackedChatDataFields, BackendFields, DataSourceFields, TrainingFlowConfig):
    """Parameters of the sft flow (the Prefect UI form and the CLI options; groups listed last-first)."""

    kind: ClassVar[str] = "sft"

    dataset: DatasetId = DEFAULT_DATASET
    eval_dataset: EvalDatasetId = DEFAULT_EVAL_DATASET
    router_aux_loss_coef: RouterAuxLossCoef = None
    registered_model_name: RegisteredModelName = None
    experiment_name: ExperimentName = "twinkle-sft"

    @property
    def objective(self) -> str:
        """vision_lm for a vision-language model (rows with images and videos), causal_lm otherwise."""
        family = family_before_download(self.model_id)
        return "vision_lm" if family is not None and family.is_vision else "causal_lm"

    def objective_options(self) -> dict:
        return VisionFields.objective_options(self) if self.objective == "vision_lm" else {}

    def problems(self, model_config) -> list[str]:
        kind = get_objective(self.objective).row_kind
        if self.packing and not get_row_format(kind).packable:
            return [f"packing=True: {kind} rows are not packed yet (each image's 3-D positions would have to "
                    "restart per sample); set packing=false"]
        return []

    def model_name(self) -> str:
        return self.registered_model_name or default_model_name(self.model_id)

    def run_config(self, model: ModelRef, train_data: str, checkpoint_dir: Path, run_id: str) -> TrainRunConfig:
        given = dict(model_path=model.path, **model.ref_options(), train_data=train_data, checkpoint_dir=checkpoint_dir,
                     parallel=self.parallel(), objective=self.objective, objective_options=self.objective_options(),
                     mlflow_run_id=run_id,
                     tracking_uri=tracking_uri())
        shared = (set(TrainRunConfig.model_fields) & set(SFTConfig.model_fields)) - set(given)
        return TrainRunConfig(**self.model_dump(include=shared), **given)


@flow(name="sft", on_failure=[discard_bare_run_folder])
def sft(config: SFTConfig = SFTConfig()) -> dict:
    """Fine-tune `config.model_id` on `config.dataset` and register the result in MLflow."""
    run_dir = run_folder(config.output_dir, config)  # a retry of this flow run gets the same folder and resumes
    model = download_model(config.model_id, **config.model_options())
    config.check_model(model)  # model-dependent rules (tp_size vs the heads, ...) before anything else runs
    plan = plan_benchmarks(config, model)  # a benchmark that cannot run offline fails here, before training
    train_file = download_dataset(config.dataset, config.streaming)  # the held-out set is small: a file
    eval_file = download_dataset(config.eval_dataset)
    objective = get_objective(config.objective)
    kind, media = objective.row_kind, objective.encode_options(config.objective_options()) or None
    train_data = tokenize(train_file, model, config.max_length, config.packing, config.max_bad_fraction,
                          config.enable_thinking, kind, media, num_proc=config.num_proc)
    eval_data = tokenize(eval_file, model, config.max_length, False, config.max_bad_fraction, config.enable_thinking,
                         kind, media, num_proc=config.num_proc)
    prompts = sample_prompts(eval_file, config.eval_prompts, kind)
    hf_model = model  # evaluation loads the trained adapter or model with transformers
    model = convert(model, config.backend, config.tp_size, config.pp_size, config.timeout_minutes * 60)
    with TrackedRun(config, run_dir, "sft") as tracked:
        run_config = config.run_config(model, train_data.path, run_dir / "checkpoints", tracked.run_id)
        checkpoint = train(run_config, str(run_dir), timeout_s=config.timeout_minutes * 60,
                           device_limit=config.device_limit)
        if checkpoint is None:  # a multi-machine run: the machine with global rank 0 evaluates and registers
            return handed_off(tracked.run_id, model.family)
        reports = evaluate(hf_model, checkpoint, eval_data, prompts, str(run_dir), config.mixed_precision,
                           config.max_new_tokens, tracked.run_id, objective=config.objective,
                           objective_options=config.objective_options())
        bench = run_benchmarks(config, plan, hf_model, checkpoint, run_dir, tracked.run_id)
        registration = register(checkpoint, config.model_name(), tracked.run_id, tags=tracked.tags, base=hf_model,
                                dataset=train_file, register_as=config.register_as,
                                **champion_metric(config, bench, reports["trained"]["eval_loss"], "eval_loss", False))
    run_id, links = tracked.run_id, tracked.links
    summary = with_benchmarks(render_summary(config, prompts, reports, registration, run_id, checkpoint, train_data,
                                             links, hf_model.family), bench)
    create_markdown_artifact(summary, key="sft-summary", description="base vs trained model")
    get_run_logger().info("run summary:\n%s", summary)
    return {"summary": summary, "run_id": run_id, "registration": registration, "reports": reports,
            "benchmarks": bench, "checkpoint": checkpoint.path, "probe_loss": checkpoint.probe_loss,
            "train_data": train_data.path, "family": model.family}


def main(argv: list[str] | None = None) -> int:
    return run_from_cli(sft, SFTConfig, argv, __doc__)


if __name__ == "__main__":
    sys.exit(main())
