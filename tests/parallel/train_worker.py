"""Test worker: train with the real recipe under some layout; rank 0 writes what the tests compare.

    python -m torch.distributed.run --standalone --nproc-per-node 2 -m train_worker run.json OUT   # 2 processes
    python -m train_worker run.json OUT                                                           # the reference

OUT/result.json: per-step metrics, each rank's local parameter / optimizer-state bytes next to the full
sizes, the FSDP units, the trainable parameter names and the checkpoint path. OUT/weights.safetensors: the
trainable weights after training, gathered to full tensors.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.fsdp import FSDPModule

from twinkle_core.models.checkpoint import gather_full_state_dict
from twinkle_core.parallel import is_main_process
from twinkle_core.train import TrainRunConfig
from twinkle_core.train.recipe import SFTRecipe


class StepRecorder:
    """Stands in for the MLflow MetricsLogger: every step's metrics at full precision, plus its trained tokens."""

    def __init__(self, model):
        self.model = model
        self.steps: list[dict] = []

    def log(self, metrics: dict, step: int) -> None:
        self.steps.append({"step": step, **metrics, "trained_tokens": self.model.stepper.last.trained_tokens})

    def flush(self) -> None:
        pass


def _local_bytes(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.numel() * local.element_size()


def _full_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()  # a DTensor's numel is the global one


def memory_shares(model) -> dict:
    """What this rank holds of the parameters and of the optimizer state, against the full sizes."""
    params = list(model.model.parameters())
    optimizer = getattr(model.stepper.optimizer, "optimizer", model.stepper.optimizer)  # Accelerate wraps it
    states = [v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v) and v.dim() > 0]
    return {"param_bytes": sum(map(_local_bytes, params)), "param_full_bytes": sum(map(_full_bytes, params)),
            "optim_bytes": sum(map(_local_bytes, states)), "optim_full_bytes": sum(map(_full_bytes, states))}


def local_shapes(model) -> dict[str, list[list[int]]]:
    """Each parameter's [local shard shape, full shape] on this rank (tensor parallelism: the DTensor shard)."""
    return {name: [list((p.to_local() if hasattr(p, "to_local") else p).shape), list(p.shape)]
            for name, p in model.model.named_parameters()}


def trainable_weights(model) -> dict[str, torch.Tensor]:
    if dist.is_initialized():
        state = gather_full_state_dict(model.model, trainable_only=True)
    else:
        state = {n: p.detach() for n, p in model.model.named_parameters() if p.requires_grad}
    return {name: tensor.contiguous().clone() for name, tensor in state.items()}


def main(config_path: str, out_dir: str) -> None:
    recipe = SFTRecipe(TrainRunConfig.read(config_path))
    recipe.setup()
    recipe.metrics = StepRecorder(recipe.model)
    recipe.train()
    shares, shapes = [memory_shares(recipe.model)], [local_shapes(recipe.model)]
    if dist.is_initialized():
        shares, shapes = [None] * dist.get_world_size(), [None] * dist.get_world_size()
        dist.all_gather_object(shares, memory_shares(recipe.model))
        dist.all_gather_object(shapes, local_shapes(recipe.model))
    weights = trainable_weights(recipe.model)
    checkpoint = recipe.save_checkpoint()
    runner = recipe.model._loss_module()
    if is_main_process():
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        save_file(weights, out / "weights.safetensors")
        (out / "result.json").write_text(json.dumps({
            "strategy": recipe.model.parallel.name, "steps": recipe.metrics.steps, "shares": shares,
            "local_shapes": shapes,
            "fsdp_units": sum(isinstance(m, FSDPModule) for m in runner.modules()),
            "trainable": [n for n, p in recipe.model.model.named_parameters() if p.requires_grad],
            "checkpoint": str(checkpoint),
        }, indent=1))
    recipe.cleanup()


if __name__ == "__main__":
    main(*sys.argv[1:])
