"""Expert parallelism (`ep_size > 1`) for mixture-of-experts models on the Transformers backend.

Layout. EP adds no ranks: the D = dp × fsdp data-parallel ranks (each with its own share of the batch)
are cut into D / ep *ep groups* of `ep` consecutive data-parallel ranks. Inside an ep group, rank i keeps
experts [i·E/ep, (i+1)·E/ep) of every MoE layer: contiguous slices along dim 0 of the experts module's
3-D weights (`gate_up_proj [E, 2I, H]`, `down_proj [E, H, I]`). The ranks at the same position of every
ep group hold the same experts: they form the *expert-data-parallel* group (D / ep ranks, size 1 when
ep = D). Router, shared experts, attention and everything else stay whole and are trained data-parallel
by the usual strategy (DDP, or FSDP via Accelerate or natively), which is told to leave the expert
shards alone (DDP's ignore list, FSDP2's `ignored_params`). The experts are sharded in `prepare`
(set_optimizer), like FSDP shards: after loading, adding LoRA and `load`, from the whole model each rank loaded.

Dispatch. Each experts module keeps its class and parameter names; its forward is replaced (the one
patch, `shard_experts`) by: sort this rank's (token, k) rows by expert (hence by owner rank), exchange the
per-owner row counts, all-to-all the rows and their local expert ids to the owners (an all-to-all whose
backward returns each row's gradient to its sender), run the family's own experts forward on the received
rows (each row one token with weight 1, over the E/ep local experts), all-to-all the outputs back, weight
them by the router's top-k weights and add them into the tokens in ascending expert order, as the dense
module does. The router and the loss are unchanged.

Gradients (derivation). One process trains on the token mean of the global batch, so the gradient of an
expert weight W is g = Σ_r ∂S_r/∂W / N, with S_r the summed token loss of data-parallel rank r and N the
step's trained tokens. The stepper multiplies every gradient by D / N (twinkle_core.parallel.strategy): it
expects what DDP/FSDP leave, the average Σ_r ∂S_r/∂W / D. Under EP the backward of the all-to-all sends
each row's gradient back to the expert's owner, so W.grad on its owner is already Σ over the ranks of its
ep group; summing it over the expert-data-parallel group extends that to Σ over all D ranks. Dividing by
D gives the average the stepper expects, so: expert grad ← all_reduce_sum(grad, expert-dp group) / D, done
once per optimizer step, after the last micro-batch's backward (where DDP exchanges its gradients).

Clipping counts every expert once: norm² = ‖rest‖² (replicated, or FSDP DTensors) + Σ over the ep group
of the local expert shards' squares (the expert-dp replicas are equal after the reduction).

Checkpoints: `gather_expert_weights` all-gathers the shards over the ep group, so rank 0 writes the
single-process checkpoint. LoRA: PEFT adapts linear layers, not the 3-D expert weights, so with EP a LoRA
run adapts attention, router and shared experts while the experts stay frozen (still dispatched, since
activations need their gradients); an adapter placed inside an experts module is refused.

Supported: model types whose experts module has this interface, found from the model class itself
(EXPERT_PARALLEL_MODEL_TYPES lists those checked against the dense module by tests/parallel/test_parallel_ep.py);
not combined with tp or sp.
"""
from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from peft.tuners.tuners_utils import BaseTunerLayer

from twinkle_core.parallel.strategy import BuildOptimizer, DataParallelStrategy, norm_as_float

# Experts modules stored as 3-D tensors and called experts(hidden_states, top_k_index, top_k_weights).
EXPERT_PARALLEL_MODEL_TYPES = ("qwen3_moe", "qwen3_5_moe", "qwen3_5_moe_text", "deepseek_v3", "deepseek_v4")


# ----- validation before launch ------------------------------------------------------------------------
def ep_unsupported(sizes: dict[str, int]) -> list[str]:
    """Why a layout with ep_size > 1 cannot run (empty: it can); TP with EP is reported by tp_unsupported."""
    if sizes.get("ep_size", 1) == 1 or sizes.get("sp_size", 1) == 1:
        return []
    return [f"ep_size={sizes['ep_size']} with sp_size={sizes['sp_size']}: expert parallelism combined with sequence "
            "parallelism is not supported; use sp_size=1 with ep_size > 1."]


_DISPATCH_ARGUMENTS = ["hidden_states", "top_k_index", "top_k_weights"]


def _has_dispatchable_experts(config: Any) -> bool:
    """Whether the model's experts modules have the interface EP shards, read from the model class itself:
    built on the meta device (no memory, no weights), every experts module must hold 3-D weights and be
    called experts(hidden_states, top_k_index, top_k_weights)."""
    import inspect

    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    experts = [m for m in model.modules() if is_experts_module(m)]
    return bool(experts) and all(
        list(inspect.signature(type(m).forward).parameters)[1:4] == _DISPATCH_ARGUMENTS for m in experts)


def ep_model_problem(config: Any, ep_size: int) -> str | None:
    """A model whose experts module EP cannot shard (checked from the config, before any process starts).

    The model types of EXPERT_PARALLEL_MODEL_TYPES are verified against the dense module by the tests; any
    other qualifies when its experts modules have the same interface.
    """
    model_type = getattr(config, "model_type", None)
    if ep_size == 1 or model_type in EXPERT_PARALLEL_MODEL_TYPES or _has_dispatchable_experts(config):
        return None
    return (f"ep_size={ep_size}: model_type {model_type!r} has no experts module expert parallelism can shard "
            "(experts as 3-D weights [experts, ...], called experts(hidden_states, top_k_index, top_k_weights)); "
            "use ep_size=1.")


# ----- process groups ----------------------------------------------------------------------------------
@dataclass
class ExpertGroups:
    """This rank's ep group (ranks holding different experts) and expert-data-parallel group (same experts)."""

    ep_group: Any
    ep_size: int
    ep_rank: int
    expert_dp_group: Any  # None when it is this rank alone (ep_size = dp × fsdp)
    data_parallel_size: int

    @classmethod
    def from_mesh(cls, mesh) -> "ExpertGroups":
        """Cut the data-parallel ranks into groups; every rank must call this (new_group is collective)."""
        ranks = dist.get_process_group_ranks(mesh.data_parallel_group)  # data-parallel order
        ep, me = mesh.ep_size, mesh.data_parallel_rank
        ep_group = expert_dp_group = None
        for start in range(0, len(ranks), ep):
            group = dist.new_group(ranks[start:start + ep])
            if start <= me < start + ep:
                ep_group = group
        if len(ranks) > ep:
            for offset in range(ep):
                group = dist.new_group(ranks[offset::ep])
                if me % ep == offset:
                    expert_dp_group = group
        return cls(ep_group, ep, me % ep, expert_dp_group, len(ranks))


# ----- sharding and dispatch ---------------------------------------------------------------------------
@dataclass
class ExpertShard:
    """Set on an experts module that holds this rank's slice of the experts."""

    group: Any
    ep_size: int
    ep_rank: int
    num_local: int  # experts held here; the module's num_experts


def is_experts_module(module: torch.nn.Module) -> bool:
    """Transformers' 3-D experts modules: num_experts and gate_up_proj/down_proj with the experts on dim 0."""
    count = getattr(module, "num_experts", None)
    weights = [getattr(module, name, None) for name in ("gate_up_proj", "down_proj")]
    return (isinstance(count, int) and all(isinstance(w, torch.nn.Parameter) and w.dim() == 3 for w in weights)
            and all(w.shape[0] == count for w in weights) and getattr(module, "expert_shard", None) is None)


def sharded_experts(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if getattr(m, "expert_shard", None) is not None]


def expert_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The expert shards (each rank's own slices): no data-parallel wrapper may broadcast or reduce them."""
    return [p for module in sharded_experts(model) for p in module.parameters()]


def expert_parameter_names(model: torch.nn.Module) -> list[str]:
    shards = {id(p) for p in expert_parameters(model)}
    return [name for name, p in model.named_parameters() if id(p) in shards]


def shard_experts(model: torch.nn.Module, groups: ExpertGroups) -> None:
    """Keep this rank's experts in every experts module and install the all-to-all forward."""
    modules = [m for m in model.modules() if is_experts_module(m)]
    if not modules:
        raise ValueError(f"ep_size={groups.ep_size}: {type(model).__name__} has no experts module stored as 3-D "
                         "weights (gate_up_proj, down_proj); expert parallelism cannot shard it, use ep_size=1.")
    adapted = [name for name, m in model.named_modules()
               if isinstance(m, BaseTunerLayer) and is_experts_module(m.get_base_layer())]
    if adapted:
        raise ValueError(f"ep_size={groups.ep_size}: a LoRA adapter targets the expert weights ({adapted[0]}); with "
                         "expert parallelism adapt attention and shared layers only (target_modules, no "
                         "target_parameters on the experts), or use ep_size=1.")
    for module in modules:
        total = module.num_experts
        local = total // groups.ep_size
        first = groups.ep_rank * local
        for name, param in list(module.named_parameters(recurse=False)):
            if param.shape[0] != total:
                raise ValueError(f"ep_size={groups.ep_size}: {type(module).__name__}.{name} has shape "
                                 f"{tuple(param.shape)}, not the experts on dim 0; use ep_size=1.")
            piece = param.detach()[first:first + local].clone()
            setattr(module, name, torch.nn.Parameter(piece, requires_grad=param.requires_grad))
        module.num_experts = local
        module.expert_shard = ExpertShard(groups.ep_group, groups.ep_size, groups.ep_rank, local)
        module.forward = functools.partial(_dispatch_forward, module, type(module).forward)


def _all_to_all(send: torch.Tensor, recv_splits: list[int], send_splits: list[int], group) -> torch.Tensor:
    out = send.new_empty((sum(recv_splits), *send.shape[1:]))
    dist.all_to_all_single(out, send.contiguous(), recv_splits, send_splits, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    """all_to_all_single whose backward sends each row's gradient back to the rank the row came from."""

    @staticmethod
    def forward(ctx, send, recv_splits, send_splits, group):
        ctx.splits, ctx.group = (recv_splits, send_splits), group
        return _all_to_all(send, recv_splits, send_splits, group)

    @staticmethod
    def backward(ctx, grad):
        recv_splits, send_splits = ctx.splits
        return _all_to_all(grad, send_splits, recv_splits, ctx.group), None, None, None


def _dispatch_forward(module: torch.nn.Module, local_forward, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                      top_k_weights: torch.Tensor) -> torch.Tensor:
    """experts(hidden_states, top_k_index, top_k_weights) with the experts spread over the ep group."""
    shard: ExpertShard = module.expert_shard
    top_k = top_k_index.shape[-1]
    experts = top_k_index.reshape(-1)
    order = torch.argsort(experts, stable=True)  # by expert, hence by owner; ties keep token order
    token_of_row = order // top_k
    send_counts = torch.bincount(experts // shard.num_local, minlength=shard.ep_size)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=shard.group)
    send_splits, recv_splits = send_counts.tolist(), recv_counts.tolist()
    rows = _AllToAll.apply(hidden_states[token_of_row], recv_splits, send_splits, shard.group)
    local_ids = _all_to_all(experts[order] % shard.num_local, recv_splits, send_splits, shard.group)
    ones = torch.ones(len(local_ids), 1, dtype=rows.dtype, device=rows.device)
    out = local_forward(module, rows, local_ids[:, None], ones)
    out = _joined_to_backward(out, rows, *module.parameters())
    back = _AllToAll.apply(out, send_splits, recv_splits, shard.group)
    weighted = (back * top_k_weights.reshape(-1)[order, None]).to(hidden_states.dtype)
    return torch.zeros_like(hidden_states).index_add_(0, token_of_row, weighted)


def _joined_to_backward(out: torch.Tensor, *sources: torch.Tensor) -> torch.Tensor:
    """A rank that received no rows still has to take part in the backward all-to-alls the others run."""
    needing = [s for s in sources if s.requires_grad]
    if out.requires_grad or not needing or not torch.is_grad_enabled():
        return out
    return out + sum(s.sum() for s in needing) * 0


# ----- gradients, clipping, checkpoints ------------------------------------------------------------------
def reduce_expert_gradients(parameters: list[torch.nn.Parameter], groups: ExpertGroups) -> None:
    """Turn each shard's ep-group gradient sum into the data-parallel average (module docstring)."""
    for param in parameters:
        if param.grad is None:  # none of this ep group's rows reached these experts
            param.grad = torch.zeros_like(param)
        if groups.expert_dp_group is not None:
            dist.all_reduce(param.grad, op=dist.ReduceOp.SUM, group=groups.expert_dp_group)
        param.grad.div_(groups.data_parallel_size)


def clip_grad_norm_ep(parameters: list[torch.nn.Parameter], max_norm: float, groups: ExpertGroups,
                      expert_ids: set[int]) -> float:
    """Clip by the norm of the whole (unsharded) gradient; returns that norm."""
    dense = [p.grad for p in parameters if p.grad is not None and id(p) not in expert_ids]
    experts = [p.grad for p in parameters if p.grad is not None and id(p) in expert_ids]
    dense_norm = norm_as_float(torch.nn.utils.get_total_norm(dense)) if dense else 0.0
    expert_sq = torch.zeros((), dtype=torch.float64, device=(experts or dense)[0].device)
    for grad in experts:
        expert_sq += torch.linalg.vector_norm(grad, 2, dtype=torch.float32).double() ** 2
    dist.all_reduce(expert_sq, op=dist.ReduceOp.SUM, group=groups.ep_group)
    norm = math.sqrt(dense_norm ** 2 + float(expert_sq))
    coef = max_norm / (norm + 1e-6)
    if coef < 1.0:
        for grad in dense + experts:
            grad.mul_(coef)
    return norm


def gather_expert_weights(model: torch.nn.Module, trainable_only: bool = False) -> dict[str, torch.Tensor]:
    """Full expert weights (CPU) under their state-dict names, on every rank; every rank must call it."""
    full = {}
    for prefix, module in model.named_modules():
        shard = getattr(module, "expert_shard", None)
        if shard is None:
            continue
        for name, param in module.named_parameters(recurse=False):
            if trainable_only and not param.requires_grad:
                continue
            pieces = [torch.empty_like(param.data) for _ in range(shard.ep_size)]
            dist.all_gather(pieces, param.data.contiguous(), group=shard.group)
            full[f"{prefix}.{name}"] = torch.cat(pieces).cpu()
    return full


def expert_full_shapes(model: torch.nn.Module) -> dict[str, list[int]]:
    """The unsharded shape of each expert shard, by parameter name."""
    shapes = {}
    for prefix, module in model.named_modules():
        shard = getattr(module, "expert_shard", None)
        for name, param in module.named_parameters(recurse=False) if shard is not None else ():
            shapes[f"{prefix}.{name}"] = [param.shape[0] * shard.ep_size, *param.shape[1:]]
    return shapes


# ----- the strategy --------------------------------------------------------------------------------------
class ExpertParallel(DataParallelStrategy):
    """Experts sharded over ep groups; everything else trained by `inner` (DDP, native or Accelerate FSDP)."""

    is_sharded = True

    def __init__(self, inner: DataParallelStrategy):
        super().__init__(inner.mesh, inner.precision)
        self.inner = inner
        self.name = f"{inner.name}+ep"
        self.groups = ExpertGroups.from_mesh(inner.mesh)
        self.expert_params: list[torch.nn.Parameter] = []

    def prepare(self, module: torch.nn.Module, build_optimizer: BuildOptimizer):
        if not sharded_experts(module):
            shard_experts(module, self.groups)
        self.expert_params = [p for p in expert_parameters(module) if p.requires_grad]
        return self.inner.prepare(module, build_optimizer)

    @contextlib.contextmanager
    def gradient_sync(self, module: torch.nn.Module, enabled: bool):
        with self.inner.gradient_sync(module, enabled):
            yield
        if enabled:
            reduce_expert_gradients(self.expert_params, self.groups)

    def backward(self, loss: torch.Tensor) -> None:
        self.inner.backward(loss)

    def clip_grad_norm_(self, parameters: list[torch.nn.Parameter], max_norm: float) -> float:
        return clip_grad_norm_ep(parameters, max_norm, self.groups, {id(p) for p in self.expert_params})
