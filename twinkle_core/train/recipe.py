"""The SFT training recipe that torchrun starts in each worker process.

    python -m torch.distributed.run --standalone --nproc-per-node 1 -m twinkle_core.train run.json

setup → train → save_checkpoint → cleanup. Progress goes to stdout as `TWINKLE_EVENT {json}` lines
(the train task turns them into Prefect progress) and metrics to MLflow, both from rank 0 only.

Several processes: the mesh comes from `parallel` (twinkle_core.parallel). Every rank walks the same
seeded order and cuts the same global micro-batches of `batch_size` rows; each data-parallel rank trains
on its share (`local_rows`), so the steps, losses and weights are those of one process.

Any backend (twinkle_core.models.backends): the recipe only calls the verbs of TrainableModel.

Resume: every `checkpoint_every` steps the model saves a resumable training state (`save_training_state`);
a run started again on the same `checkpoint_dir` continues from it, skipping the micro-batches of the
seeded order it already trained on.
"""
from __future__ import annotations

import json
import logging
import math
import random
import time
from pathlib import Path

import torch
from transformers import AutoConfig

from twinkle_core.data import get_row_format, load_tokenized
from twinkle_core.entry import worker_config_path
from twinkle_core.models.backends import get_backend
from twinkle_core.objectives import get_objective
from twinkle_core.parallel import is_main_process, local_micro_batches, world_size_from_env
from twinkle_core.parallel.process_group import abandon_exit_barrier
from twinkle_core.perf import StepPerf
from twinkle_core.tracking import MetricsLogger
from twinkle_core.train.config import TrainRunConfig
from twinkle_core.train.prefetch import Prefetcher

logger = logging.getLogger(__name__)
EVENT_PREFIX = "TWINKLE_EVENT "


def emit(event: str, **fields) -> None:
    """One machine-readable progress line on stdout (rank 0: the ranks agree on every number)."""
    if not is_main_process():
        return
    print(EVENT_PREFIX + json.dumps({"event": event, **fields}), flush=True)


class SFTRecipe:
    def __init__(self, config: TrainRunConfig):
        self.config = config

    def setup(self) -> None:
        cfg = self.config
        random.seed(cfg.seed)
        torch.manual_seed(cfg.seed)
        self.examples = load_tokenized(cfg.train_data)
        if not self.examples:
            raise ValueError(f"train_data {cfg.train_data} holds no examples.")
        self.objective = get_objective(cfg.objective)
        self.row_format = get_row_format(self.objective.row_kind)  # how its examples batch and count
        self.model = get_backend(cfg.backend).build(cfg)
        self.mask_dtype = self.model.precision.compute_dtype  # packed 4-D masks must match sdpa's dtype
        self.pad_id = self.model.tokenizer.pad_token_id
        if self.pad_id is None:
            self.pad_id = self.model.tokenizer.eos_token_id
        if cfg.use_lora:
            self.model.add_adapter_to_model(cfg.adapter_name, cfg.lora_config(), cfg.gradient_accumulation_steps)
        self.model.set_optimizer(cfg.optimizer, lr=cfg.lr, weight_decay=cfg.weight_decay,
                                 gradient_accumulation_steps=cfg.gradient_accumulation_steps)
        self.total_steps = self._count_steps()
        self.model.set_lr_scheduler(cfg.scheduler, num_warmup_steps=int(cfg.warmup_ratio * self.total_steps),
                                    num_training_steps=self.total_steps)
        self.metrics = MetricsLogger(cfg.tracking_uri, cfg.mlflow_run_id if is_main_process() else None)
        trainable = sum(p.numel() for p in self.model.trainable_parameters())
        emit("setup", examples=len(self.examples), total_steps=self.total_steps, trainable_params=trainable)
        # Read from disk: a DDP/FSDP wrapper hides the model's config.
        seq_len = round(self.examples.meta["num_tokens"] / self.examples.meta["num_sequences"])  # counted once
        self.perf = StepPerf(AutoConfig.from_pretrained(self.model.hf_dir), seq_len, self.model.device,
                             world_size_from_env(), self.model.precision.compute_dtype,
                             lora_params=trainable if cfg.use_lora else None,
                             data_parallel_size=self.model.data_parallel_size, auto_class=self.objective.auto_class)
        if is_main_process():  # the only rank that reports: the others never measure the peak
            emit("perf", **self.perf.describe())
        self.start_step = self._resume()  # last: it restores the RNG state that training continues with

    def _save_training_state(self) -> None:
        self.model.save_training_state(self.config.checkpoint_dir, {"settings": self._resume_settings()},
                                       keep=self.config.keep_checkpoints)

    def _resume_settings(self) -> dict:
        """What must be the same for a saved training state to be resumed (same data order and schedule)."""
        cfg = self.config
        return {"train_data": str(cfg.train_data), "batch_size": cfg.batch_size, "seed": cfg.seed,
                "gradient_accumulation_steps": cfg.gradient_accumulation_steps, "total_steps": self.total_steps,
                "use_lora": cfg.use_lora, "lora_r": cfg.lora_r, "optimizer": cfg.optimizer, "lr": cfg.lr,
                "scheduler": cfg.scheduler, "group_by_length": cfg.group_by_length}

    def _resume(self) -> int:
        """The step to start from: that of the last saved training state in checkpoint_dir, else 0."""
        progress = self.model.load_training_state(self.config.checkpoint_dir, self._resume_settings())
        if progress is None:
            return 0
        emit("resume", step=progress["step"], total=self.total_steps)
        return progress["step"]

    def _count_steps(self) -> int:
        cfg = self.config
        per_epoch = math.ceil(len(self.examples) / cfg.batch_size) // cfg.gradient_accumulation_steps
        steps = max(1, math.ceil(per_epoch * cfg.epochs))
        return cfg.max_steps or steps

    def _batches(self, skip: int = 0):
        """This rank's collated micro-batches (`local_micro_batches`); the first `skip` were trained before a resume."""
        rows = local_micro_batches(self.examples, self.config.batch_size, self.config.seed,
                                   self.model.data_parallel_rank, self.model.data_parallel_size, skip,
                                   group_by_length=self.config.group_by_length)
        batches = (self._collate(share) for share in rows)
        steps = self.config.gradient_accumulation_steps
        if self.objective.embed is not None and steps > 1:
            # contrastive: a step's micro-batches go in together, accumulated exactly through cached embeddings
            batches = (list(step) for step in zip(*[batches] * steps))
        return Prefetcher(batches)  # the next micro-batches are read and collated while this one trains

    def _collate(self, examples: list[dict]) -> dict:
        if getattr(self.model, "padding_free", False):  # the model takes its samples end to end, unpadded
            return self.row_format.collate_padding_free(examples)
        return self.row_format.collate(examples, pad_token_id=self.pad_id, mask_dtype=self.mask_dtype)

    def train(self) -> None:
        cfg, step, started = self.config, self.start_step, time.perf_counter()
        batches = self._batches(skip=step * cfg.gradient_accumulation_steps)
        try:
            self._train_steps(batches, step)
        finally:
            batches.close()
        self.train_seconds = time.perf_counter() - started

    def _train_steps(self, batches, step: int) -> None:
        cfg = self.config
        while step < self.total_steps:
            self.model.forward_backward(inputs=next(batches))
            if not self.model.clip_grad_and_step(max_grad_norm=cfg.max_grad_norm):
                continue
            step += 1
            metrics = self.model.calculate_metric(is_training=True)
            metrics.pop("step", None)
            if is_main_process():
                metrics.update(self.perf.metrics(metrics["tokens_per_s"]))
            self.metrics.log(metrics, step)
            if step % cfg.log_every == 0 or step == self.total_steps:
                emit("step", step=step, total=self.total_steps, world_size=world_size_from_env(),
                     **{k: round(v, 6) for k, v in metrics.items()})
            if cfg.checkpoint_every and step % cfg.checkpoint_every == 0 and step < self.total_steps:
                self.metrics.flush()  # the metrics up to the saved step survive a crash too
                self._save_training_state()
                emit("training_state", step=step)

    def probe_batch(self) -> dict:
        """A fixed batch (the first examples) whose loss fingerprints the trained weights."""
        return self._collate(self.examples[: self.config.batch_size])

    def save_checkpoint(self) -> Path:
        # The probe loss lets anyone check that the saved checkpoint reloads to exactly these weights.
        probe_loss = self.model.forward_only(self.probe_batch())
        self.model.calculate_metric(is_training=False)  # reset the eval accumulator
        name = self.config.adapter_name if self.config.use_lora else "model"
        path = self.model.export(name, self.config.checkpoint_dir)
        emit("checkpoint", path=str(path), train_seconds=round(self.train_seconds, 2), probe_loss=probe_loss)
        return path

    def cleanup(self) -> None:
        self.metrics.flush()
        self.model.close()


def run_recipe(recipe) -> int:
    """setup → train → save_checkpoint, with cleanup (MLflow flush, leaving the process group) always."""
    recipe.setup()
    try:
        recipe.train()
        recipe.save_checkpoint()
    except BaseException:
        abandon_exit_barrier()  # the other ranks may wait in a collective this one left: end with the error
        raise
    finally:
        recipe.cleanup()
    return 0


def main(argv: list[str] | None = None) -> int:
    path = worker_config_path(argv, "python -m twinkle_core.train RUN_CONFIG.json")
    return run_recipe(SFTRecipe(TrainRunConfig.read(path)))
