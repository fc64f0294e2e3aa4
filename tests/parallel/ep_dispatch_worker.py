"""Test worker: an experts module sharded over 2 ranks (all-to-all dispatch) equals the dense module.

    python -m torch.distributed.run --standalone --nproc-per-node 2 -m ep_dispatch_worker OUT.json

For each supported model type's experts class and each experts implementation (eager loop, grouped_mm),
every rank builds the same dense module and draws every rank's tokens (same seed), computes the dense
reference over all of them, then shards the experts and runs only its own tokens through the EP module.
Rank 0 writes the largest differences: outputs, gradients of the hidden states and of the router weights,
and each rank's expert-weight gradients against the dense ones of its experts (the all-to-all backward
sums the contributions of both ranks' tokens). Routings: random, and one where every token picks experts
0 and 1, so rank 1 receives no rows and must still join the backward all-to-alls.
"""
from __future__ import annotations

import importlib
import json
import sys

import torch
import torch.distributed as dist
from transformers import AutoConfig

from twinkle_core.parallel import DeviceMesh
from twinkle_core.parallel.expert import ExpertGroups, shard_experts
from twinkle_core.parallel.process_group import close_distributed
from twinkle_core.entry import finish_worker

HIDDEN, EXPERTS, TOP_K, TOKENS = 16, 4, 2, (7, 3)  # unequal shares of tokens per rank
CLASSES = {
    "qwen3_moe": ("qwen3_moe", "Qwen3MoeExperts", dict(num_experts=EXPERTS, moe_intermediate_size=8)),
    "qwen3_5_moe_text": ("qwen3_5_moe", "Qwen3_5MoeExperts", dict(num_experts=EXPERTS, moe_intermediate_size=8)),
    "deepseek_v3": ("deepseek_v3", "DeepseekV3Experts", dict(n_routed_experts=EXPERTS, moe_intermediate_size=8)),
    "deepseek_v4": ("deepseek_v4", "DeepseekV4Experts", dict(n_routed_experts=EXPERTS, intermediate_size=8)),
    # Not in EXPERT_PARALLEL_MODEL_TYPES: an untested family qualifies by its experts module's interface alone.
    "mixtral": ("mixtral", "MixtralExperts", dict(num_local_experts=EXPERTS, intermediate_size=8)),
}


def build(model_type: str, implementation: str) -> torch.nn.Module:
    package, name, sizes = CLASSES[model_type]
    config = AutoConfig.for_model(model_type, hidden_size=HIDDEN, **sizes)
    config._experts_implementation = implementation
    cls = getattr(importlib.import_module(f"transformers.models.{package}.modeling_{package}"), name)
    torch.manual_seed(0)
    module = cls(config)
    for param in module.parameters():
        torch.nn.init.normal_(param, std=0.3)
    return module


def draw(routing: str) -> list[tuple[torch.Tensor, ...]]:
    """Every rank's (hidden, top_k_index, top_k_weights, probe), identical on all ranks."""
    torch.manual_seed(1)
    shares = []
    for n in TOKENS:
        index = torch.rand(n, EXPERTS).topk(TOP_K).indices
        if routing == "one_rank_idle":
            index = torch.tensor([[0, 1]] * n)
        shares.append((torch.randn(n, HIDDEN), index, torch.rand(n, TOP_K), torch.randn(n, HIDDEN)))
    return shares


def run(module: torch.nn.Module, hidden, index, weights, probe):
    hidden, weights = hidden.clone().requires_grad_(), weights.clone().requires_grad_()
    out = module(hidden, index, weights)
    (out * probe).sum().backward()
    return out.detach(), hidden.grad, weights.grad


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item() if a.numel() else 0.0


def compare(model_type: str, implementation: str, routing: str, groups: ExpertGroups, rank: int) -> dict:
    shares = draw(routing)
    dense = build(model_type, implementation)
    whole = [torch.cat(parts) for parts in zip(*shares)]
    ref_out, ref_hidden_grad, ref_weight_grad = run(dense, *whole)
    first = sum(TOKENS[:rank])
    mine = slice(first, first + TOKENS[rank])
    sharded = build(model_type, implementation)
    shard_experts(sharded, groups)
    out, hidden_grad, weight_grad = run(sharded, *shares[rank])
    local = slice(rank * EXPERTS // 2, (rank + 1) * EXPERTS // 2)
    expert_grads = [max_diff(p.grad if p.grad is not None else torch.zeros_like(p), dict(dense.named_parameters())[n].grad[local])
                    for n, p in sharded.named_parameters()]
    return {"out": max_diff(out, ref_out[mine]), "hidden_grad": max_diff(hidden_grad, ref_hidden_grad[mine]),
            "router_weight_grad": max_diff(weight_grad, ref_weight_grad[mine]), "expert_grads": max(expert_grads),
            "local_experts": sharded.gate_up_proj.shape[0]}


def main(out_path: str) -> None:
    mesh = DeviceMesh.from_sizes(fsdp_size=2, ep_size=2)
    groups = ExpertGroups.from_mesh(mesh)
    rank = dist.get_rank()
    results = {f"{t}/{impl}/{routing}": compare(t, impl, routing, groups, rank)
               for t in CLASSES for impl in ("eager", "grouped_mm") for routing in ("random", "one_rank_idle")}
    gathered = [None, None]
    dist.all_gather_object(gathered, results)
    if rank == 0:
        with open(out_path, "w") as file:
            json.dump(gathered, file, indent=1)
    close_distributed()


if __name__ == "__main__":
    finish_worker(main(*sys.argv[1:]))
