"""Test worker: the multi-tenant recipe under some layout; rank 0 writes what the tests compare.

    python -m torch.distributed.run --standalone --nproc-per-node 2 -m multi_lora_worker run.json OUT
    python -m multi_lora_worker run.json OUT                                   # the one-process reference

OUT/result.json: each tenant's per-step metrics, each rank's local adapter / optimizer-state bytes next to
the full sizes, and the checkpoint paths. OUT/weights.safetensors: every tenant's adapter weights after
training, gathered to full tensors.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch.distributed as dist
from safetensors.torch import save_file

from train_worker import _full_bytes, _local_bytes, trainable_weights
from twinkle_core.parallel import is_main_process
from twinkle_core.train.multi_lora import MultiLoraRecipe
from twinkle_core.train.multi_lora_config import MultiLoraRunConfig
from twinkle_core.entry import finish_worker


class TenantRecorder:
    """Stands in for a tenant's MLflow logger: every step's metrics at full precision, plus its trained tokens."""

    def __init__(self, model, tenant: str):
        self.model, self.tenant, self.steps = model, tenant, []

    def log(self, metrics: dict, step: int) -> None:
        trained = self.model.slots.get(self.tenant, "record").stepper.last.trained_tokens
        self.steps.append({"step": step, **metrics, "trained_tokens": trained})

    def flush(self) -> None:
        pass


def memory_shares(model) -> dict:
    """What this rank holds of all tenants' adapter weights and optimizer states, against the full sizes."""
    params = [p for name in model.adapter_names() for p in model.tenant_parameters(name)]
    states = []
    for name in model.adapter_names():
        optimizer = model.slots.get(name, "shares").stepper.optimizer
        optimizer = getattr(optimizer, "optimizer", optimizer)  # Accelerate wraps it
        states += [v for s in optimizer.state.values() for v in s.values() if v.dim() > 0]
    return {"param_bytes": sum(map(_local_bytes, params)), "param_full_bytes": sum(map(_full_bytes, params)),
            "optim_bytes": sum(map(_local_bytes, states)), "optim_full_bytes": sum(map(_full_bytes, states))}


def main(config_path: str, out_dir: str) -> None:
    recipe = MultiLoraRecipe(MultiLoraRunConfig.read(config_path))
    recipe.setup()
    for run in recipe.tenants.values():
        run.metrics = TenantRecorder(recipe.model, run.name)
    recipe.train()
    shares = [memory_shares(recipe.model)]
    if dist.is_initialized():
        shares = [None] * dist.get_world_size()
        dist.all_gather_object(shares, memory_shares(recipe.model))
    weights = trainable_weights(recipe.model)
    checkpoints = recipe.save_checkpoint()
    if is_main_process():
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        save_file(weights, out / "weights.safetensors")
        (out / "result.json").write_text(json.dumps({
            "strategy": recipe.model.parallel.name, "shares": shares, "failed": recipe.failed,
            "steps": {name: run.metrics.steps for name, run in recipe.tenants.items()},
            "checkpoints": {name: str(path) for name, path in checkpoints.items()},
        }, indent=1))
    recipe.cleanup()


if __name__ == "__main__":
    finish_worker(main(*sys.argv[1:]))
