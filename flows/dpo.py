"""Preference training (DPO, IPO, SimPO, ORPO): download → tokenize → (reference log-probs) → train →
evaluate → register.

    python -m flows.dpo                      # the embedded default: SmolLM2-135M-Instruct prefers to be Twinkle
    python -m flows.dpo --rpo-alpha 0        # plain DPO (the default adds RPO's SFT term on the chosen reply)
    python -m flows.dpo --loss-type simpo --beta 2.0 --simpo-gamma 0.5     # reference-free
    python -m flows.dpo --precompute-reference true    # reference log-probs once, in a cached task
    python -m flows.dpo --nproc-per-node 2 --dp-size 2    # DDP; each pair stays whole on one rank
    python -m flows.dpo --help               # every option

Rows are {"messages" | "prompt", "chosen", "rejected"} (also ms-swift's messages + rejected_response).
With LoRA the reference is the base model with the adapter disabled; for full training, a frozen copy.
The champion is decided by held-out reward accuracy.
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
from flows.tracked import TrackedRun
from flows.summary import _one_line, _precision, _settings, family_line, handed_off, registry_lines
from tasks.download import download_dataset, download_model
from tasks.evaluate_preference import evaluate_preference, reference_logps
from tasks.prompts import sample_prompts
from tasks.refs import ModelRef
from tasks.register import register
from tasks.tokenize import tokenize
from tasks.train import train
from twinkle_core.config.fields import (AdapterFields, BackendFields, BenchmarkFields, BatchSize, ChatDataFields,
                                        CheckpointFields,
                                        DataParallelFields, DatasetId, DataSourceFields, Epochs, EvalDatasetId,
                                        EvalFields, ExperimentName, LearningRate, LoopFields, MachinesFields,
                                        MaxLength, ModelParallelFields, OptimizerFields, PreferenceFields,
                                        ProcessFields, RegisteredModelName, RpoAlpha, RunFields)
from twinkle_core.objectives.preference import REFERENCE_FREE
from twinkle_core.tracking import tracking_uri
from twinkle_core.train import TrainRunConfig

DEFAULT_DATASET = "pkg://twinkle_core/datasets/preference/train.jsonl"
DEFAULT_EVAL_DATASET = "pkg://twinkle_core/datasets/preference/heldout.jsonl"
CHAMPION_METRIC = "reward_accuracy"  # a new version becomes champion when its held-out reward accuracy is higher


class DPOConfig(RunFields, BenchmarkFields, EvalFields, ModelParallelFields, DataParallelFields, MachinesFields,
                ProcessFields,
                OptimizerFields, LoopFields, CheckpointFields, AdapterFields, PreferenceFields, ChatDataFields,
                BackendFields, DataSourceFields, TrainingFlowConfig):
    """Parameters of the dpo flow (the Prefect UI form and the CLI options; groups listed last-first)."""

    kind: ClassVar[str] = "dpo"
    objective: ClassVar[str] = "preference"

    dataset: DatasetId = DEFAULT_DATASET
    eval_dataset: EvalDatasetId = DEFAULT_EVAL_DATASET
    max_length: MaxLength = 256
    epochs: Epochs = 1.0
    batch_size: BatchSize = 8  # pairs: each step reads 2 x batch_size sequences
    lr: LearningRate = 5e-4
    # RPO (DPO plus the chosen reply's NLL): plain DPO may lower both replies' log-probs and still win the
    # margin; on the default run the chosen log-prob then rose only from -70 to -54 and the model did not
    # say the chosen answer. With 1.0 it rose to -2.1 and it does. --rpo-alpha 0 is plain DPO.
    rpo_alpha: RpoAlpha = 1.0
    registered_model_name: RegisteredModelName = None
    experiment_name: ExperimentName = "twinkle-dpo"

    def problems(self, model_config) -> list[str]:
        if self.precompute_reference and self.loss_type in REFERENCE_FREE:
            return [f"precompute_reference=True: loss_type={self.loss_type!r} uses no reference model; "
                    "leave precompute_reference off"]
        return []

    def model_name(self) -> str:
        return self.registered_model_name or default_model_name(self.model_id, "dpo-")

    def run_config(self, model: ModelRef, train_data: str, checkpoint_dir: Path, run_id: str) -> TrainRunConfig:
        given = dict(model_path=model.path, **model.ref_options(), train_data=train_data, checkpoint_dir=checkpoint_dir,
                     parallel=self.parallel(), objective=self.objective, objective_options=self.objective_options(),
                     mlflow_run_id=run_id, tracking_uri=tracking_uri())
        shared = (set(TrainRunConfig.model_fields) & set(DPOConfig.model_fields)) - set(given)
        return TrainRunConfig(**self.model_dump(include=shared), **given)


def render_dpo_summary(config: DPOConfig, prompts: list[list[dict]], reports: dict, registration: dict, run_id: str,
                       checkpoint, train_data, family: str, links: dict[str, str]) -> str:
    base, trained = reports["base"], reports["trained"]
    metrics = checkpoint.final_metrics
    lines = [
        "## Twinkle Flows: DPO summary", "",
        f"model: {config.model_id}", family_line(family),
        f"dataset: {config.dataset} ({train_data.num_rows} pairs, {train_data.num_trained_tokens} reply tokens, "
        f"{train_data.num_bad} bad rows skipped)",
        _settings(config),
        f"objective: {config.loss_type}, beta {config.beta:g}"
        + (f", gamma {config.simpo_gamma:g}" if config.loss_type == "simpo" else "")
        + (f", rpo_alpha {config.rpo_alpha:g}" if config.rpo_alpha else "")
        + (", reference log-probs precomputed" if config.precompute_reference else ""),
        f"training: {'LoRA r=' + str(config.lora_r) if config.use_lora else 'full'}, {_precision(config.mixed_precision)}, "
        f"{checkpoint.train_seconds:.0f} s, final loss {metrics.get('loss', float('nan')):.4f}, "
        f"final train reward accuracy {metrics.get('rewards/accuracy', float('nan')):.4f}",
        f"held-out: {trained['pairs']} pairs", "",
        f"base reward accuracy: {base['reward_accuracy']:.4f}",
        f"trained reward accuracy: {trained['reward_accuracy']:.4f}", "",
        "| | base | trained |", "|---|---|---|",
        f"| reward accuracy | {base['reward_accuracy']:.4f} | {trained['reward_accuracy']:.4f} |",
        f"| mean margin | {base['margin']:.4f} | {trained['margin']:.4f} |",
        f"| chosen log-prob | {base['logps_chosen']:.4f} | {trained['logps_chosen']:.4f} |",
        f"| rejected log-prob | {base['logps_rejected']:.4f} | {trained['logps_rejected']:.4f} |", "",
    ]
    if "dpo_reward_accuracy" in trained:
        lines += [f"DPO implicit rewards against the base (beta {config.beta:g}): accuracy "
                  f"{trained['dpo_reward_accuracy']:.4f}, margin {trained['dpo_reward_margin']:.4f}", ""]
    if prompts:
        lines += [f"prompt: {_one_line(prompts[0][-1]['content'])}",
                  f"base answer: {_one_line(base['answers'][0])}",
                  f"trained answer: {_one_line(trained['answers'][0])}", ""]
    return "\n".join(lines + registry_lines(run_id, registration, checkpoint, links))


@flow(name="dpo", on_failure=[discard_bare_run_folder])
def dpo(config: DPOConfig = DPOConfig()) -> dict:
    """Train `config.model_id` on the preference pairs of `config.dataset` and register it in MLflow."""
    run_dir = run_folder(config.output_dir, config)  # a retry of this flow run gets the same folder and resumes
    model = download_model(config.model_id, **config.model_options())
    config.check_model(model)
    plan = plan_benchmarks(config, model)  # a benchmark that cannot run offline fails here, before training
    train_file = download_dataset(config.dataset, config.streaming)  # the held-out set is small: a file
    eval_file = download_dataset(config.eval_dataset)
    train_data = tokenize(train_file, model, config.max_length, False, config.max_bad_fraction,
                          config.enable_thinking, "preference", num_proc=config.num_proc)
    heldout = tokenize(eval_file, model, config.max_length, False, config.max_bad_fraction, config.enable_thinking,
                       "preference", num_proc=config.num_proc)
    prompts = sample_prompts(eval_file, config.eval_prompts, kind="preference")
    if config.precompute_reference:  # training then holds no reference model
        train_data = reference_logps(model, train_data, str(run_dir), config.mixed_precision,
                                     config.timeout_minutes * 60)
    with TrackedRun(config, run_dir, "dpo") as tracked:
        run_config = config.run_config(model, train_data.path, run_dir / "checkpoints", tracked.run_id)
        checkpoint = train(run_config, str(run_dir), timeout_s=config.timeout_minutes * 60,
                           device_limit=config.device_limit)
        if checkpoint is None:  # a multi-machine run: the machine with global rank 0 evaluates and registers
            return handed_off(tracked.run_id, model.family)
        reports = evaluate_preference(model, checkpoint, heldout, prompts, str(run_dir), config.mixed_precision,
                                      config.loss_type, config.beta, config.max_new_tokens, tracked.run_id,
                                      config.timeout_minutes * 60)
        bench = run_benchmarks(config, plan, model, checkpoint, run_dir, tracked.run_id)
        registration = register(checkpoint, config.model_name(), tracked.run_id, tags=tracked.tags, base=model,
                                dataset=train_file, register_as=config.register_as,
                                **champion_metric(config, bench, reports["trained"][CHAMPION_METRIC],
                                                  "eval_" + CHAMPION_METRIC, True))
    run_id, links = tracked.run_id, tracked.links
    summary = with_benchmarks(render_dpo_summary(config, prompts, reports, registration, run_id, checkpoint,
                                                 train_data, model.family, links), bench)
    create_markdown_artifact(summary, key="dpo-summary", description="base vs trained on held-out preference pairs")
    get_run_logger().info("run summary:\n%s", summary)
    return {"summary": summary, "run_id": run_id, "registration": registration, "reports": reports,
            "benchmarks": bench, "checkpoint": checkpoint.path, "probe_loss": checkpoint.probe_loss,
            "train_data": train_data.path, "family": model.family}


def main(argv: list[str] | None = None) -> int:
    return run_from_cli(dpo, DPOConfig, argv, __doc__)


if __name__ == "__main__":
    sys.exit(main())
