"""The multi-tenant LoRA recipe that torchrun starts in each worker process: many adapters, one base model.

    python -m torch.distributed.run --standalone --nproc-per-node 1 -m twinkle_core.train.multi_lora run.json

setup → train → save_checkpoint → cleanup, like the SFT recipe, for every tenant of the run at once, on
MultiLoraTransformersModel or (`backend="megatron"`) MultiLoraMegatronModel; both write PEFT adapters. Each
round takes the next micro-batch of every tenant that still has steps to go and either trains them in one
mixed batch (one base-model pass; `mixed_batches`) or one after another; each tenant then steps on its own
accumulation boundary, with its own optimizer and schedule, and logs to its own MLflow run.

A tenant fails alone: one whose data cannot be read or whose adapter is refused is reported as a
`tenant_failed` event and left out, and the others train. Progress goes to stdout as `TWINKLE_EVENT` lines
(rank 0); several processes split every tenant's micro-batches like the SFT recipe (`local_rows`).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from twinkle_core.data import collate, load_tokenized
from twinkle_core.entry import finish_worker, worker_config_path
from twinkle_core.models.backends import get_backend
from twinkle_core.parallel import is_main_process, local_micro_batches, world_size_from_env
from twinkle_core.tracking import MetricsLogger
from twinkle_core.train.multi_lora_config import MultiLoraRunConfig, TenantRunConfig
from twinkle_core.train.recipe import emit, run_recipe


@dataclass
class TenantRun:
    config: TenantRunConfig
    examples: list[dict]
    total_steps: int
    metrics: MetricsLogger
    step: int = 0
    batches: Iterator[list[dict]] | None = None
    consumed: int = 0  # this rank's micro-batches taken from `batches` (where a resumed run continues)

    @property
    def name(self) -> str:
        return self.config.name


class MultiLoraRecipe:
    def __init__(self, config: MultiLoraRunConfig):
        self.config = config
        self.tenants: dict[str, TenantRun] = {}
        self.failed: dict[str, str] = {}
        self.rounds = 0  # each gives every unfinished tenant one micro-batch
        self.saved_round = 0

    def setup(self) -> None:
        cfg = self.config
        self.model = get_backend(cfg.backend).build_multi_tenant(cfg)
        self.pad_id = self.model.tokenizer.pad_token_id
        if self.pad_id is None:
            self.pad_id = self.model.tokenizer.eos_token_id
        for tenant in cfg.tenants:  # every adapter before the first optimizer: several processes wrap once
            try:
                self._add_tenant(tenant)
            except Exception as exc:  # noqa: BLE001 - this tenant fails alone; the event carries its error
                self._fail(tenant.name, exc)
        if not self.tenants:
            raise RuntimeError(f"every tenant failed: {self.failed}")
        for run in self.tenants.values():
            tenant = run.config
            self.model.set_optimizer(tenant.optimizer, lr=tenant.lr, weight_decay=tenant.weight_decay,
                                     gradient_accumulation_steps=tenant.gradient_accumulation_steps,
                                     adapter_name=tenant.name)
            self.model.set_lr_scheduler(tenant.scheduler, num_warmup_steps=int(tenant.warmup_ratio * run.total_steps),
                                        num_training_steps=run.total_steps, adapter_name=tenant.name)
            run.batches = self._batches(run)
            emit("tenant_setup", tenant=tenant.name, examples=len(run.examples), total_steps=run.total_steps,
                 trainable_params=sum(p.numel() for p in self.model.tenant_parameters(tenant.name)))
        self._resume()

    def _settings(self) -> dict:
        """What a resumed run must share with the saved one: the layout and every tenant's training settings."""
        cfg = self.config
        return {"backend": cfg.backend, "world_size": world_size_from_env(), "mixed_batches": cfg.mixed_batches,
                "parallel": cfg.parallel.model_dump(mode="json"), "micro_batch_size": cfg.micro_batch_size,
                "tenants": {run.name: run.config.model_dump(mode="json", exclude={"mlflow_run_id"})
                            for run in self.tenants.values()}}

    def _resume(self) -> None:
        """Continue from the newest intact state of an earlier attempt of this run, if there is one: each
        tenant's weights, optimizer, schedule, step and place in its data order."""
        progress = self.model.load_training_state(self.config.checkpoint_dir, self._settings())
        if progress is None:
            return
        self.rounds = self.saved_round = progress["round"]
        for name, done in progress["tenants"].items():
            run = self.tenants[name]
            run.step = done["step"]
            for _ in range(done["consumed"]):
                next(run.batches)
            run.consumed = done["consumed"]
        emit("resume", step=self.rounds, tenants={name: done["step"] for name, done in progress["tenants"].items()})

    def _save_state_if_due(self) -> None:
        """Every `checkpoint_every` rounds, at the first round after which no tenant holds accumulated
        gradients (each is between optimizer steps), unless every tenant is done."""
        every = self.config.checkpoint_every
        runs = self.tenants.values()
        if not every or self.rounds - self.saved_round < every or all(r.step >= r.total_steps for r in runs):
            return
        if any(r.consumed % r.config.gradient_accumulation_steps for r in runs if r.step < r.total_steps):
            return
        progress = {"round": self.rounds, "tenants": {r.name: {"step": r.step, "consumed": r.consumed} for r in runs},
                    "settings": self._settings()}
        self.model.save_training_state(self.config.checkpoint_dir, progress, keep=self.config.keep_checkpoints)
        self.saved_round = self.rounds
        emit("tenant_state_saved", step=self.rounds, tenants={r.name: r.step for r in runs})

    def _add_tenant(self, tenant: TenantRunConfig) -> None:
        examples = load_tokenized(tenant.train_data)
        if not examples:
            raise ValueError(f"train_data {tenant.train_data} holds no examples.")
        torch.manual_seed(tenant.seed)  # the adapter's initial weights (megatron: seeded per layer)
        seeded = {"seed": tenant.seed} if self.config.backend == "megatron" else {}
        self.model.add_adapter_to_model(tenant.name, tenant.lora_config(), tenant.gradient_accumulation_steps,
                                        **seeded)
        per_epoch = math.ceil(len(examples) / tenant.batch_size) // tenant.gradient_accumulation_steps
        total = tenant.max_steps or max(1, math.ceil(per_epoch * tenant.epochs))
        run_id = tenant.mlflow_run_id if is_main_process() else None
        self.tenants[tenant.name] = TenantRun(tenant, examples, total, MetricsLogger(self.config.tracking_uri, run_id))

    def _fail(self, name: str, exc: BaseException) -> None:
        self.failed[name] = f"{type(exc).__name__}: {exc}"
        emit("tenant_failed", tenant=name, error=self.failed[name])

    def _batches(self, run: TenantRun) -> Iterator[list[dict]]:
        """This rank's rows of the tenant's micro-batches: a seeded shuffle per epoch, forever."""
        return local_micro_batches(run.examples, run.config.batch_size, run.config.seed,
                                   self.model.data_parallel_rank, self.model.data_parallel_size)
    def _collate(self, rows: list[dict]) -> dict:
        return collate(rows, pad_token_id=self.pad_id, mask_dtype=self.model.precision.compute_dtype)

    def train(self) -> None:
        started = time.perf_counter()
        while active := [run for run in self.tenants.values() if run.step < run.total_steps]:
            rows = {run.name: next(run.batches) for run in active}
            for run in active:
                run.consumed += 1
            if self.config.mixed_batches:  # one base-model pass for every tenant's micro-batch
                names = [name for name, share in rows.items() for _ in share]
                self.model.forward_backward(inputs=self._collate([r for share in rows.values() for r in share]),
                                            adapter_name=names)
            else:
                for name, share in rows.items():
                    self.model.forward_backward(inputs=self._collate(share), adapter_name=name)
            for run in active:
                if self.model.clip_grad_and_step(max_grad_norm=run.config.max_grad_norm, adapter_name=run.name):
                    self._log_step(run)
            self.rounds += 1
            self._save_state_if_due()
        self.train_seconds = time.perf_counter() - started

    def _log_step(self, run: TenantRun) -> None:
        run.step += 1
        metrics = self.model.calculate_metric(is_training=True, adapter_name=run.name)
        metrics.pop("step", None)
        run.metrics.log(metrics, run.step)
        if run.step % self.config.log_every == 0 or run.step == run.total_steps:
            emit("tenant_step", tenant=run.name, step=run.step, total=run.total_steps,
                 world_size=world_size_from_env(), **{k: round(v, 6) for k, v in metrics.items()})

    def save_checkpoint(self) -> dict[str, Path]:
        """Each tenant's PEFT adapter directory, with a probe loss that fingerprints its weights."""
        paths = {}
        for run in self.tenants.values():
            probe = self._collate(run.examples[:run.config.batch_size])
            probe_loss = self.model.forward_only(probe, adapter_name=run.name)
            self.model.calculate_metric(is_training=False, adapter_name=run.name)  # reset the eval sums
            paths[run.name] = self.model.save(run.name, self.config.checkpoint_dir, adapter_name=run.name)
            emit("tenant_checkpoint", tenant=run.name, path=str(paths[run.name]),
                 train_seconds=round(self.train_seconds, 2), probe_loss=probe_loss)
        return paths

    def cleanup(self) -> None:
        for run in self.tenants.values():
            run.metrics.flush()
        self.model.close()


def main(argv: list[str] | None = None) -> int:
    path = worker_config_path(argv, "python -m twinkle_core.train.multi_lora RUN_CONFIG.json")
    return run_recipe(MultiLoraRecipe(MultiLoraRunConfig.read(path)))


if __name__ == "__main__":
    finish_worker(main())
