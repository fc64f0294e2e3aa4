"""Test worker: train with the real recipe under some layout; rank 0 writes what the tests compare.

    python -m torch.distributed.run --standalone --nproc-per-node 2 -m train_worker run.json OUT   # 2 processes
    python -m train_worker run.json OUT                                                           # the reference

OUT/result.json: per-step metrics, each rank's local parameter / optimizer-state bytes next to the full
sizes, the sequence lengths each rank's first attention layer ran on, the FSDP units, the spread of whole
(replicated) weights across ranks, the trainable parameter names and the checkpoint path. OUT/weights.safetensors: the
trainable weights after training, gathered to full tensors.
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.fsdp import FSDPModule

from twinkle_core.models.checkpoint import gather_full_state_dict
from twinkle_core.objectives.embedding import register_infonce
from twinkle_core.objectives.infonce import gather_detached
from twinkle_core.parallel import is_main_process
from twinkle_core.parallel.expert import expert_full_shapes
from twinkle_core.train import TrainRunConfig
from twinkle_core.train.grpo import GRPORecipe
from twinkle_core.train.recipe import SFTRecipe
from twinkle_core.entry import finish_worker


# InfoNCE with the other ranks' embeddings detached (Twinkle's gather): shown to differ from one process.
register_infonce("infonce_detached", gather=gather_detached)


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
    params = dict(model.model.named_parameters())
    experts = expert_full_shapes(model.model)  # expert parallelism: plain tensors holding a slice of the experts
    full_bytes = {name: math.prod(experts[name]) * p.element_size() if name in experts else _full_bytes(p)
                  for name, p in params.items()}
    optimizer = getattr(model.stepper.optimizer, "optimizer", model.stepper.optimizer)  # Accelerate wraps it
    states = [v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v) and v.dim() > 0]
    return {"param_bytes": sum(map(_local_bytes, params.values())), "param_full_bytes": sum(full_bytes.values()),
            "optim_bytes": sum(map(_local_bytes, states)), "optim_full_bytes": sum(map(_full_bytes, states))}


def local_shapes(model) -> dict[str, list[list[int]]]:
    """Each parameter's [local shard shape, full shape] on this rank (TP/FSDP: the DTensor shard; EP: the experts)."""
    experts = expert_full_shapes(model.model)
    return {name: [list((p.to_local() if hasattr(p, "to_local") else p).shape), experts.get(name, list(p.shape))]
            for name, p in model.model.named_parameters()}


def record_attention_lengths(model) -> list[int]:
    """The sequence length of every call of the first attention layer (this rank's slice under sp)."""
    lengths: list[int] = []
    attention = next((m for name, m in model.model.named_modules() if name.endswith("self_attn")), None)
    if attention is None:  # an encoder (BERT) names its attention otherwise; nothing to record
        return lengths
    attention.register_forward_pre_hook(
        lambda module, args, kwargs: lengths.append((args[0] if args else kwargs["hidden_states"]).shape[1]),
        with_kwargs=True)
    return lengths


def replicated_spread(model) -> float | None:
    """Largest difference between ranks of the trainable weights every rank holds whole (None: there are none).

    Under tensor parallelism these are the norms, embeddings and the unsharded LoRA matrices: equal after
    training only if every tp rank computed the same gradients for them.
    """
    whole = [p.detach() for p in model.model.parameters() if p.requires_grad and not hasattr(p, "to_local")]
    if not whole or not dist.is_initialized():
        return None
    flat = torch.cat([p.reshape(-1).float() for p in whole])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    return max((g - gathered[0]).abs().max().item() for g in gathered)


def trainable_weights(model) -> dict[str, torch.Tensor]:
    if dist.is_initialized():
        state = gather_full_state_dict(model.model, trainable_only=True)
    else:
        state = {n: p.detach() for n, p in model.model.named_parameters() if p.requires_grad}
    return {name: tensor.contiguous().clone() for name, tensor in state.items()}


class FixedSampler:
    """GRPO rollouts that depend on the prompt only: completion j of a prompt is its last 2 + 2j tokens,
    reversed. Every layout then trains on the same completions, with rewards (their lengths) that differ
    within a group."""

    def sample(self, prompt_ids, num_generations, settings, seed):
        return [list(reversed(ids[-(2 + 2 * j):])) for ids in prompt_ids for j in range(num_generations)]


def main(config_path: str, out_dir: str) -> None:
    config = TrainRunConfig.read(config_path)
    recipe = (GRPORecipe if config.objective == "grpo" else SFTRecipe)(config)
    recipe.setup()
    if config.objective == "grpo" and not Path(out_dir).parent.name.endswith("_sampled"):
        recipe.sampler = FixedSampler()
    recipe.metrics = StepRecorder(recipe.model)
    lengths = record_attention_lengths(recipe.model)
    recipe.train()
    shares, shapes, attention = [memory_shares(recipe.model)], [local_shapes(recipe.model)], [list(lengths)]
    if dist.is_initialized():
        shares, shapes, attention = ([None] * dist.get_world_size() for _ in range(3))
        dist.all_gather_object(shares, memory_shares(recipe.model))
        dist.all_gather_object(shapes, local_shapes(recipe.model))
        dist.all_gather_object(attention, list(lengths))
    spread = replicated_spread(recipe.model)
    weights = trainable_weights(recipe.model)
    checkpoint = recipe.save_checkpoint()
    runner = recipe.model._loss_module()
    if is_main_process():
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        save_file(weights, out / "weights.safetensors")
        (out / "result.json").write_text(json.dumps({
            "strategy": recipe.model.parallel.name, "steps": recipe.metrics.steps, "shares": shares,
            "local_shapes": shapes, "attention_lengths": attention, "replicated_spread": spread,
            "fsdp_units": sum(isinstance(m, FSDPModule) for m in runner.modules()),
            "trainable": [n for n, p in recipe.model.model.named_parameters() if p.requires_grad],
            "checkpoint": str(checkpoint),
        }, indent=1))
    recipe.cleanup()


if __name__ == "__main__":
    finish_worker(main(*sys.argv[1:]))
