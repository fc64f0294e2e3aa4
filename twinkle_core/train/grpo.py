"""The GRPO recipe: rollout ↔ update, in each worker process torchrun starts.

    python -m torch.distributed.run --standalone --nproc-per-node 1 -m twinkle_core.train.grpo run.json

Each rollout takes `batch_size` prompts of the seeded order (the same global order as SFT's batches; each
data-parallel rank takes its share), samples `num_generations` completions of each with the sampler
(twinkle_core.rl.sampler: the policy's own generate), scores them with the reward functions
(twinkle_core.rl.rewards), and turns each prompt's group of rewards into advantages. A group is sampled
and scored on one rank, so its statistics are the whole group's. Under FSDP every rank gathers the whole
model once per rollout and generates alone (per-token gathers would not pair up across ranks). Then `num_iterations` optimizer steps
train on the same completions (the first pass's log-probs are the "old" ones of the clipped ratio).

Seeds: the sampler of rank r at rollout k uses seed `seed * 1_000_003 + k * 1_009 + r`, so reruns sample
the same completions and ranks sample different ones.
"""
from __future__ import annotations

import json
import time

import torch

from twinkle_core.data.encode import IGNORE_INDEX
from twinkle_core.entry import finish_worker, worker_config_path
from twinkle_core.objectives.grpo import completion_logps, rollout_options
from twinkle_core.parallel import local_micro_batches, world_size_from_env
from twinkle_core.rl.grpo import group_advantages
from twinkle_core.rl.rewards import RewardSet
from twinkle_core.rl.sampler import (PolicySampler, SamplingSettings, completion_batch,
                                     completion_batch_padding_free)
from twinkle_core.train.config import TrainRunConfig
from twinkle_core.train.recipe import SFTRecipe, emit, run_recipe



class GRPORecipe(SFTRecipe):
    def setup(self) -> None:
        super().setup()
        options = rollout_options(self.config.objective_options)
        self.rollout = options
        self.rewards = RewardSet(options["rewards"], options["reward_weights"] or [], options["reward_options"])
        self.settings = SamplingSettings(options["max_new_tokens"], options["temperature"], options["top_p"])
        configured = getattr(self.model.model.generation_config, "eos_token_id", None)
        configured = configured if isinstance(configured, list) else [configured]
        eos_ids = sorted({*configured, self.model.tokenizer.eos_token_id} - {None})  # chat models stop at several
        self.sampler = PolicySampler(self.model.model, self.pad_id, eos_ids, self.model.device,
                                     lambda: self.model.precision.autocast(self.model.device.type))

    def _count_steps(self) -> int:
        """Optimizer steps: max_steps, else rollouts (len(prompts) / batch_size an epoch) x num_iterations."""
        if self.config.max_steps:
            return self.config.max_steps
        return super()._count_steps() * rollout_options(self.config.objective_options)["num_iterations"]

    def _rollouts(self, skip: int):
        cfg = self.config
        return local_micro_batches(self.examples, cfg.batch_size, cfg.seed, self.model.data_parallel_rank,
                                   self.model.data_parallel_size, skip)

    def make_rollout(self, examples: list[dict], index: int) -> tuple[dict, dict[str, float]]:
        """Sample, score and batch this rank's completions; the rollout's metrics over every rank."""
        generations = self.rollout["num_generations"]
        prompt_ids = [list(e["prompt_ids"]) for e in examples]
        seed = self.config.seed * 1_000_003 + index * 1_009 + self.model.data_parallel_rank
        completions = self.sampler.sample(prompt_ids, generations, self.settings, seed)
        texts = self.model.tokenizer.batch_decode(completions, skip_special_tokens=True)
        rows = [{**json.loads(e["fields"]), "row": e.get("row", i)} for i, e in enumerate(examples)
                for _ in range(generations)]
        prompts = [e["prompt_text"] for e in examples for _ in range(generations)]
        total, per_function = self.rewards.score(prompts, texts, rows, completions)
        batch = completion_batch_padding_free(prompt_ids, completions, generations, IGNORE_INDEX) \
            if self.model.padding_free else completion_batch(prompt_ids, completions, generations, self.pad_id,
                                                             IGNORE_INDEX)
        batch["advantages"] = group_advantages(total, generations, self.rollout["scale_rewards"])
        valid = torch.tensor([not e.get("masked", False) for e in examples]).repeat_interleave(generations)
        batch["row_valid"] = valid
        return batch, self._rollout_metrics(total, per_function, completions, valid)

    def _rollout_metrics(self, total, per_function, completions, valid) -> dict[str, float]:
        weight = valid.float()
        lengths = torch.tensor([float(len(c)) for c in completions])
        series = {"reward": total, **{f"rewards/{name}": values for name, values in per_function.items()},
                  "completion_length": lengths}
        sums = [float(weight.sum())]
        for values in series.values():
            sums += [float((values * weight).sum()), float((values ** 2 * weight).sum())]
        count, *sums = self.model.parallel.all_reduce_sum(sums)
        metrics = {}
        for n, name in enumerate(series):
            mean = sums[2 * n] / max(1.0, count)
            metrics[name] = mean
            metrics[f"{name}_std"] = max(0.0, sums[2 * n + 1] / max(1.0, count) - mean ** 2) ** 0.5
        return metrics

    def _old_logps(self, batch: dict) -> torch.Tensor:
        """The policy's log-probs of the sampled tokens before the update, aligned with labels."""
        with torch.no_grad(), self.model.precision.autocast(self.model.device.type):
            logps, _, selected, _ = completion_logps(self.model.model, batch)
        aligned = torch.zeros(batch["labels"].shape, dtype=torch.float32)
        aligned[:, 1:][selected.cpu()] = logps.float().cpu()
        return aligned

    def train(self) -> None:
        cfg, step, started = self.config, self.start_step, time.perf_counter()
        iterations = self.rollout["num_iterations"]
        rollouts = self._rollouts(skip=step // iterations)
        index = step // iterations
        while step < self.total_steps:
            began = time.perf_counter()
            # FSDP: the whole model gathered once, for the sampling (each rank generates alone, for as many
            # tokens as it needs) and the old log-probs
            with self.model.whole_weights():
                batch, rollout_metrics = self.make_rollout(next(rollouts), index)
                if iterations > 1:
                    batch["old_logps"] = self._old_logps(batch)
            rollout_seconds = time.perf_counter() - began
            index += 1
            for _ in range(min(iterations, self.total_steps - step)):
                began = time.perf_counter()
                self.model.forward_backward(inputs=batch)
                self.model.clip_grad_and_step(max_grad_norm=cfg.max_grad_norm)
                step += 1
                metrics = self.model.calculate_metric(is_training=True)
                metrics.pop("step", None)
                metrics.update(rollout_metrics, rollout_s=rollout_seconds, update_s=time.perf_counter() - began)
                self.metrics.log(metrics, step)
                emit("step", step=step, total=self.total_steps, world_size=world_size_from_env(),
                     **{k: round(v, 6) for k, v in metrics.items()})
            if cfg.checkpoint_every and step % cfg.checkpoint_every == 0 and step < self.total_steps:
                self.metrics.flush()
                self._save_training_state()
                emit("training_state", step=step)
        self.train_seconds = time.perf_counter() - started

    def probe_batch(self) -> dict:
        """A fixed batch whose loss fingerprints the weights: the first prompts with themselves as completion."""
        examples = self.examples[: self.config.batch_size]
        prompts = [list(e["prompt_ids"]) for e in examples]
        batch = completion_batch(prompts, prompts, 1, self.pad_id, IGNORE_INDEX)
        batch["advantages"] = torch.ones(len(prompts))
        batch["old_logps"] = torch.zeros(batch["labels"].shape)  # ratio = p(token): the loss moves with the weights
        return batch


def main(argv: list[str] | None = None) -> int:
    path = worker_config_path(argv, "python -m twinkle_core.train.grpo RUN_CONFIG.json")
    return run_recipe(GRPORecipe(TrainRunConfig.read(path)))


if __name__ == "__main__":
    finish_worker(main())
