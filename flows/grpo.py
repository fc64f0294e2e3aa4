"""Online RL with GRPO: download → tokenize prompts → train (rollout ↔ update) → evaluate → register.

    python -m flows.grpo                      # the embedded default: SmolLM2-135M-Instruct on bundled sums
    python -m flows.grpo --rewards '["numeric_match", "my_rewards:concise"]' --reward-weights '[1.0, 0.2]'
    python -m flows.grpo --grpo-loss-type dapo --epsilon-high 0.28 --kl-beta 0.04 --num-iterations 2
    python -m flows.grpo --help               # every option

Rows are {"prompt" | "messages", ...fields} (e.g. "solution"); reward functions get the prompts, the
completions and those fields (trl's convention). Each step samples `num_generations` completions of
`batch_size` prompts with the policy, scores them, and trains on group-normalised advantages.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import ClassVar

from prefect import flow, get_run_logger
from pydantic import model_validator
from prefect.artifacts import create_markdown_artifact

from flows.benchmarks import champion_metric, plan_benchmarks, run_benchmarks, with_benchmarks
from flows.cli import run_from_cli
from flows.params import TrainingFlowConfig, default_model_name
from flows.run_folder import discard_bare_run_folder, run_folder
from flows.tracked import TrackedRun
from flows.summary import _one_line, _precision, _settings, family_line, handed_off, registry_lines
from tasks.download import download_dataset, download_model
from tasks.evaluate_rewards import evaluate_rewards
from tasks.refs import ModelRef
from tasks.register import register
from tasks.tokenize import tokenize
from tasks.train import train
from twinkle_core.config.fields import (AdapterFields, BackendFields, BenchmarkFields, BatchSize, ChatDataFields,
                                        CheckpointEvery, CheckpointFields,
                                        DataParallelFields, DatasetId, DataSourceFields, Epochs, EvalDatasetId,
                                        ExperimentName, GrpoFields, LearningRate, LoopFields, MachinesFields,
                                        MaxCompletionLength, MaxLength, MaxSteps, ModelParallelFields,
                                        OptimizerFields, ProcessFields, RegisteredModelName, RewardNames,
                                        RewardOptions, RewardWeights, RunFields)
from twinkle_core.rl.rewards import RewardError, load_reward
from twinkle_core.tracking import tracking_uri
from twinkle_core.train import TrainRunConfig

DEFAULT_DATASET = "pkg://twinkle_core/datasets/arithmetic/train.jsonl"
DEFAULT_EVAL_DATASET = "pkg://twinkle_core/datasets/arithmetic/heldout.jsonl"
NUMBER_ONLY = r"\s*-?\d+(\.\d+)?\.?\s*"
CHAMPION_METRIC = "mean_reward"  # a new version becomes champion when its held-out mean reward is higher


class GRPOConfig(RunFields, BenchmarkFields, ModelParallelFields, DataParallelFields, MachinesFields, ProcessFields,
                 OptimizerFields,
                 LoopFields, CheckpointFields, AdapterFields, GrpoFields, ChatDataFields, BackendFields,
                 DataSourceFields, TrainingFlowConfig):
    """Parameters of the grpo flow (the Prefect UI form and the CLI options; groups listed last-first)."""

    kind: ClassVar[str] = "grpo"
    objective: ClassVar[str] = "grpo"

    dataset: DatasetId = DEFAULT_DATASET
    eval_dataset: EvalDatasetId = DEFAULT_EVAL_DATASET
    max_length: MaxLength = 256  # of a prompt; longer prompts are bad rows
    # The default task's rewards: the right sum (numeric_match, the last number of the answer) and an answer
    # that is the number alone, as the prompts ask (format, half weight).
    rewards: RewardNames = ["numeric_match", "format"]
    reward_weights: RewardWeights = [1.0, 0.5]
    reward_options: RewardOptions = {"format": {"pattern": NUMBER_ONLY}}
    max_completion_length: MaxCompletionLength = 16
    epochs: Epochs = 1.0
    max_steps: MaxSteps = 24
    batch_size: BatchSize = 8  # prompts per step: batch_size x num_generations completions
    lr: LearningRate = 3e-4
    checkpoint_every: CheckpointEvery = 20
    registered_model_name: RegisteredModelName = None
    experiment_name: ExperimentName = "twinkle-grpo"

    @model_validator(mode="before")
    @classmethod
    def _weights_follow_the_rewards(cls, values):
        """Rewards of the user's own drop the default task's weights and options unless given with them."""
        if isinstance(values, dict) and "rewards" in values:
            values = {"reward_weights": None, "reward_options": {}, **values}
        return values

    def problems(self, model_config) -> list[str]:
        weights = self.reward_weights or [1.0] * len(self.rewards)
        problems = [f"reward_weights={self.reward_weights}: {len(weights)} weights for {len(self.rewards)} rewards "
                    f"{self.rewards}; give one each"] if len(weights) != len(self.rewards) else []
        for name in self.rewards:
            try:
                load_reward(name)
            except RewardError as error:
                problems.append(f"rewards: {error}")
        return problems

    def model_name(self) -> str:
        return self.registered_model_name or default_model_name(self.model_id, "grpo-")

    def run_config(self, model: ModelRef, train_data: str, checkpoint_dir: Path, run_id: str) -> TrainRunConfig:
        given = dict(model_path=model.path, **model.ref_options(), train_data=train_data, checkpoint_dir=checkpoint_dir,
                     parallel=self.parallel(), objective=self.objective, objective_options=self.objective_options(),
                     mlflow_run_id=run_id, tracking_uri=tracking_uri(), gradient_accumulation_steps=1)
        shared = (set(TrainRunConfig.model_fields) & set(GRPOConfig.model_fields)) - set(given)
        return TrainRunConfig(**self.model_dump(include=shared), **given)


def render_grpo_summary(config: GRPOConfig, reports: dict, registration: dict, run_id: str, checkpoint, train_data,
                        family: str, links: dict[str, str]) -> str:
    base, trained = reports["base"], reports["trained"]
    metrics = checkpoint.final_metrics
    weights = config.reward_weights or [1.0] * len(config.rewards)
    lines = [
        "## Twinkle Flows: GRPO summary", "",
        f"model: {config.model_id}", family_line(family),
        f"dataset: {config.dataset} ({train_data.num_rows} prompts, {train_data.num_bad} bad rows skipped)",
        _settings(config),
        "rewards: " + ", ".join(f"{name} x {weight:g}" for name, weight in zip(config.rewards, weights))
        + f"; {config.num_generations} completions per prompt, <= {config.max_completion_length} tokens, "
          f"temperature {config.sampling_temperature:g}",
        f"objective: {config.grpo_loss_type}, epsilon {config.epsilon:g}"
        + (f"/{config.epsilon_high:g}" if config.epsilon_high else "") + f", kl beta {config.kl_beta:g}, "
        f"{config.num_iterations} iteration(s) per rollout",
        f"training: {'LoRA r=' + str(config.lora_r) if config.use_lora else 'full'}, {_precision(config.mixed_precision)}, "
        f"{checkpoint.train_seconds:.0f} s, final train reward {metrics.get('reward', float('nan')):.4f}",
        f"held-out: {trained['prompts']} prompts, greedy answers", "",
        f"base mean reward: {base['mean_reward']:.4f}",
        f"trained mean reward: {trained['mean_reward']:.4f}", "",
        "| | base | trained |", "|---|---|---|",
        f"| mean reward | {base['mean_reward']:.4f} | {trained['mean_reward']:.4f} |",
        f"| accuracy ({config.rewards[0]}) | {base['accuracy']:.4f} | {trained['accuracy']:.4f} |", "",
    ]
    for i, question in enumerate(trained["questions"]):
        lines += [f"prompt: {_one_line(question)}", f"base answer: {_one_line(base['answers'][i])}",
                  f"trained answer: {_one_line(trained['answers'][i])}", ""]
    return "\n".join(lines + registry_lines(run_id, registration, checkpoint, links))


@flow(name="grpo", on_failure=[discard_bare_run_folder])
def grpo(config: GRPOConfig = GRPOConfig()) -> dict:
    """Train `config.model_id` with GRPO on the prompts of `config.dataset` and register it in MLflow."""
    run_dir = run_folder(config.output_dir, config)  # a retry of this flow run gets the same folder and resumes
    model = download_model(config.model_id, **config.model_options())
    config.check_model(model)
    plan = plan_benchmarks(config, model)  # a benchmark that cannot run offline fails here, before training
    train_file = download_dataset(config.dataset, config.streaming)  # the held-out set is small: a file
    eval_file = download_dataset(config.eval_dataset)
    train_data = tokenize(train_file, model, config.max_length, False, config.max_bad_fraction,
                          config.enable_thinking, "prompts", num_proc=config.num_proc)
    heldout = tokenize(eval_file, model, config.max_length, False, config.max_bad_fraction, config.enable_thinking,
                       "prompts", num_proc=config.num_proc)
    with TrackedRun(config, run_dir, "grpo") as tracked:
        run_config = config.run_config(model, train_data.path, run_dir / "checkpoints", tracked.run_id)
        checkpoint = train(run_config, str(run_dir), timeout_s=config.timeout_minutes * 60,
                           device_limit=config.device_limit, entry="twinkle_core.train.grpo")
        if checkpoint is None:  # a multi-machine run: the machine with global rank 0 evaluates and registers
            return handed_off(tracked.run_id, model.family)
        reports = evaluate_rewards(model, checkpoint, heldout, str(run_dir), config.mixed_precision,
                                   list(config.rewards), config.reward_weights, dict(config.reward_options),
                                   config.max_completion_length, tracked.run_id, config.timeout_minutes * 60)
        bench = run_benchmarks(config, plan, model, checkpoint, run_dir, tracked.run_id)
        registration = register(checkpoint, config.model_name(), tracked.run_id, tags=tracked.tags, base=model,
                                dataset=train_file, register_as=config.register_as,
                                **champion_metric(config, bench, reports["trained"][CHAMPION_METRIC],
                                                  "eval_" + CHAMPION_METRIC, True))
    run_id, links = tracked.run_id, tracked.links
    summary = with_benchmarks(render_grpo_summary(config, reports, registration, run_id, checkpoint, train_data,
                                                  model.family, links), bench)
    create_markdown_artifact(summary, key="grpo-summary", description="base vs trained on held-out prompts")
    get_run_logger().info("run summary:\n%s", summary)
    return {"summary": summary, "run_id": run_id, "registration": registration, "reports": reports,
            "benchmarks": bench, "checkpoint": checkpoint.path, "probe_loss": checkpoint.probe_loss,
            "train_data": train_data.path, "family": model.family}


def main(argv: list[str] | None = None) -> int:
    return run_from_cli(grpo, GRPOConfig, argv, __doc__)


if __name__ == "__main__":
    sys.exit(main())
