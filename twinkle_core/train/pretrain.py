"""The continued pre-training recipe on megatron-core, started by torchrun in each worker process.

    python -m torch.distributed.run --standalone --nproc-per-node 2 -m twinkle_core.train.pretrain run.json

setup → train → save_checkpoint → cleanup, like the SFT recipe, with MegatronModel: every step takes
`global_batch_size` sequences of the packed corpus (twinkle_core.data.pretrain; each data-parallel rank
its contiguous share), in micro-batches of `micro_batch_size`. Every `checkpoint_every` steps the model,
optimizer and step are saved as a megatron dist checkpoint; a run started again on the same
`checkpoint_dir` resumes from the last one (the sampler gives step k the same rows either way). The
validation loss is measured on the base weights before training and on the trained ones after it; the
final checkpoint is a Megatron checkpoint that the flow converts back to Hugging Face.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from pydantic import Field

from twinkle_core.config.fields import (CheckpointEvery, DocumentMasks, EvalBatches, GlobalBatchSize, MaxSteps,
                                        MicroBatchSize, MixedPrecisionMode, ModelId, ModelLoadFields, OptimizerFields,
                                        VirtualPipelineStages)
from twinkle_core.data.pretrain import PackedSplit, open_split
from twinkle_core.entry import finish_worker, worker_config_path
from twinkle_core.parallel import ParallelConfig, is_main_process, world_size_from_env
from twinkle_core.perf import StepPerf
from twinkle_core.tracking import MetricsLogger
from twinkle_core.train.config import RunConfigFile
from twinkle_core.train.recipe import emit

LATEST = "latest"  # the file in checkpoint_dir naming the last complete training checkpoint


class PretrainRunConfig(RunConfigFile, OptimizerFields, ModelLoadFields):
    """Everything a pre-training worker needs (the fields are twinkle_core.config's; flows.pretrain sets them)."""

    model_id: ModelId
    model_path: Path  # an HF directory or a Megatron checkpoint of this project
    data_dir: Path  # a packed corpus (pack_text_corpus, split_indexed_corpus) or a blend (write_blend)
    checkpoint_dir: Path
    mixed_precision: MixedPrecisionMode
    parallel: ParallelConfig
    virtual_pipeline_stages: VirtualPipelineStages
    micro_batch_size: MicroBatchSize
    global_batch_size: GlobalBatchSize
    max_steps: MaxSteps  # never empty here: the pretrain flow requires it
    document_masks: DocumentMasks
    eval_batches: EvalBatches
    log_every: int = Field(1, ge=1)
    checkpoint_every: CheckpointEvery = None
    tracking_uri: str | None = None
    mlflow_run_id: str | None = None
    use_lora: bool = False  # the train task's CheckpointRef: pre-training trains every weight


class PretrainRecipe:
    def __init__(self, config: PretrainRunConfig):
        self.config = config

    def setup(self) -> None:
        from transformers import AutoConfig

        from twinkle_core.models import MegatronModel
        from twinkle_core.models.backends import megatron_engine_options

        cfg = self.config
        torch.manual_seed(cfg.seed)
        self.train_split = open_split(cfg.data_dir, "train")  # a PackedSplit, or a blend's BlendedSplit
        self.validation = open_split(cfg.data_dir, "validation")
        self.model = MegatronModel(str(cfg.model_path), mixed_precision=cfg.mixed_precision,
                                   tp_size=cfg.parallel.tp_size, pp_size=cfg.parallel.pp_size,
                                   ep_size=cfg.parallel.ep_size, sequence_parallel=cfg.parallel.sequence_parallel,
                                   virtual_pipeline_stages=cfg.virtual_pipeline_stages,
                                   micro_batch_size=cfg.micro_batch_size, seed=cfg.seed,
                                   **megatron_engine_options(cfg.parallel, lora=False))
        dp = self.model.data_parallel_size  # global_batch_size fits it: flows.pretrain checked before launch
        self.model.set_optimizer(cfg.optimizer, lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.model.set_lr_scheduler(cfg.scheduler, num_warmup_steps=int(cfg.warmup_ratio * cfg.max_steps),
                                    num_training_steps=cfg.max_steps)
        self.metrics = MetricsLogger(cfg.tracking_uri, cfg.mlflow_run_id if is_main_process() else None)
        emit("setup", sequences=len(self.train_split), validation_sequences=len(self.validation),
             total_steps=cfg.max_steps, trainable_params=self._trainable_params(), data_parallel_size=dp)
        self.perf = StepPerf(AutoConfig.from_pretrained(self.model.hf_dir), self.train_split.seq_length,
                             self.model.device, world_size_from_env(), self.model.precision.compute_dtype,
                             data_parallel_size=dp)
        if is_main_process():  # the only rank that reports: the others never measure the peak
            emit("perf", **self.perf.describe())
        self.start_step = self._resume()
        if self.start_step == 0:
            self.base_loss = self.evaluate()

    def _trainable_params(self) -> int:
        return sum(p.numel() for p in self.model.trainable_parameters())  # this rank's part (tp × pp split it)

    def _share(self, indices: list[int]) -> list[int]:
        """This data-parallel rank's contiguous share of a global batch."""
        share = len(indices) // self.model.data_parallel_size
        return indices[self.model.data_parallel_rank * share:(self.model.data_parallel_rank + 1) * share]

    def _local_batch(self, split: PackedSplit, step: int, rows: int) -> dict:
        return split.batch(self._share(split.step_indices(step, rows, self.config.seed)), self.config.document_masks)

    def _resume(self) -> int:
        latest = self.config.checkpoint_dir / LATEST
        if not latest.is_file():
            return 0
        pointer = json.loads(latest.read_text())
        self.model.load(pointer["name"], self.config.checkpoint_dir)
        self.base_loss = pointer["base_loss"]  # measured before the first attempt trained anything
        emit("resume", step=self.model.step, total=self.config.max_steps)
        return self.model.step

    def evaluate(self) -> float:
        """Validation loss over `eval_batches` fixed batches (the same rows for base and trained weights)."""
        rows = self.model.data_parallel_size * self.config.micro_batch_size
        for indices in self.validation.eval_indices(rows, self.config.eval_batches, self.config.seed):
            self.model.forward_only(self.validation.batch(self._share(indices), self.config.document_masks))
        return self.model.calculate_metric(is_training=False)["loss"]

    def train(self) -> None:
        cfg, step, started = self.config, self.start_step, time.perf_counter()
        while step < cfg.max_steps:
            self.model.forward_backward(inputs=self._local_batch(self.train_split, step, cfg.global_batch_size))
            self.model.clip_grad_and_step(max_grad_norm=cfg.max_grad_norm)
            step = self.model.step
            metrics = {k: v for k, v in self.model.calculate_metric().items() if k not in ("step", "skipped")}
            if is_main_process():
                metrics.update(self.perf.metrics(metrics["tokens_per_s"]))
            self.metrics.log(metrics, step)
            if step % cfg.log_every == 0 or step == cfg.max_steps:
                emit("step", step=step, total=cfg.max_steps, world_size=world_size_from_env(),
                     **{k: round(v, 6) for k, v in metrics.items()})
            if cfg.checkpoint_every and step % cfg.checkpoint_every == 0 and step < cfg.max_steps:
                self._save_training_state(step)
        self.train_seconds = time.perf_counter() - started

    def _save_training_state(self, step: int) -> None:
        self.metrics.flush()
        name = f"step-{step}"
        self.model.save(name, self.config.checkpoint_dir)
        if is_main_process():  # the pointer moves only once the checkpoint is complete
            partial = self.config.checkpoint_dir / (LATEST + ".partial")
            partial.write_text(json.dumps({"name": name, "base_loss": self.base_loss}) + "\n")
            partial.replace(self.config.checkpoint_dir / LATEST)
        emit("training_state", step=step)

    def save_checkpoint(self) -> Path:
        trained_loss = self.evaluate()
        path = self.model.save("final", self.config.checkpoint_dir, with_optimizer=False)
        self.metrics.log({"validation_loss": trained_loss, "base_validation_loss": self.base_loss},
                         self.config.max_steps)
        emit("eval", base_loss=self.base_loss, trained_loss=trained_loss)
        emit("checkpoint", path=str(path), train_seconds=round(self.train_seconds, 2), probe_loss=trained_loss)
        return path

    def cleanup(self) -> None:
        self.metrics.flush()
        self.model.close()


def main(argv: list[str] | None = None) -> int:
    from twinkle_core.train.recipe import run_recipe

    path = worker_config_path(argv, "python -m twinkle_core.train.pretrain RUN_CONFIG.json")
    return run_recipe(PretrainRecipe(PretrainRunConfig.read(path)))


if __name__ == "__main__":  # dist_checkpointing's helper processes re-import the entry module
    finish_worker(main())
