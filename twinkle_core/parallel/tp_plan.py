"""A model's own Transformers tensor-parallel plan, applied with torch's `parallelize_module` over our tp mesh.

Every Transformers model names how its layers split (`model._tp_plan`: module-name patterns → style
names, e.g. `model.layers.*.self_attn.q_proj: colwise`). We load the model whole on every rank and
apply that plan ourselves over the `tp` dim of *our* device mesh, so FSDP can shard the same weights over
the `fsdp` dim afterwards (torch's 2-D FSDP × TP). Transformers' own TP loading builds its mesh over all
ranks and cannot be combined with another dim. The styles translate to torch's ParallelStyles:

    colwise                              ColwiseParallel: weight Shard(0), output sharded on the last dim
    colwise_rep, colwise_gather_output   ColwiseParallel, output gathered (Replicate)
    rowwise                              RowwiseParallel: weight Shard(1), input sharded, output all-reduced
    rowwise_rep, rowwise_split_input     RowwiseParallel from a replicated input (each rank takes its slice)
    embedding_rowwise                    RowwiseParallel on nn.Embedding: vocabulary split, lookups summed
    embedding_colwise                    ColwiseParallel on nn.Embedding: hidden dim split, gathered
    replicated_with_grad_allreduce       the weight stays whole; its gradient is summed over the tp ranks

Attention reshapes with `-1` heads, so a rank's q/k/v shards are simply its heads. Styles of other kinds
(the MoE experts' packed_colwise / moe_tp_experts, MLA's mla_kv_a_proj, ...) are refused before training
starts (`tp_plan_problems`).

LoRA (a PEFT layer: `base_layer`, `lora_A.<name>`, `lora_B.<name>`) follows its base layer:
- column-wise base: lora_A whole (its input is replicated), lora_B column-wise with the base's output
  layout, so `base(x) + B(A(x))` adds two shards of the same output features;
- row-wise base: lora_A row-wise (it reads the same input shard, its rank-r output is all-reduced),
  lora_B whole.
Whole (replicated) weights see the same activations and gradients on every tp rank, so they get equal
gradients without any exchange (the tests check it).

Tied weights (an output layer sharing the embedding matrix) stay one parameter: both plans split the
vocabulary dim (Shard(0)), and after sharding the output layer points at the embedding's DTensor again.
"""
from __future__ import annotations

import re
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module

_COLWISE = ("colwise", "colwise_rep", "colwise_gather_output")
_ROWWISE = ("rowwise", "rowwise_rep", "rowwise_split_input")
_GRAD_ALLREDUCE = "replicated_with_grad_allreduce"
_STYLES: dict[str, Callable[[], ParallelStyle]] = {
    "colwise": ColwiseParallel,
    "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
    "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
    "rowwise": RowwiseParallel,
    "rowwise_rep": lambda: RowwiseParallel(input_layouts=Replicate()),
    "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate()),
    "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),
    "embedding_colwise": lambda: ColwiseParallel(output_layouts=Replicate()),
}
TRANSLATED_STYLES = (*_STYLES, _GRAD_ALLREDUCE)


def tp_plan_problems(config: Any, tp_size: int) -> list[str]:
    """Why a model (by its config) cannot be tensor-parallel, checked before any weight is loaded."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return _plan_problems(getattr(text, "base_model_tp_plan", None), getattr(text, "model_type", "?"), tp_size)


def _plan_problems(plan: dict[str, str] | None, model_type: str, tp_size: int) -> list[str]:
    if not plan:
        return [f"tp_size={tp_size}: model_type {model_type!r} has no tensor-parallel plan (tp_plan) in "
                "Transformers; use tp_size=1 (FSDP shards any model)."]
    refused = [f"{name}: {style}" for name, style in plan.items() if style not in TRANSLATED_STYLES]
    if not refused:
        return []
    return [f"tp_size={tp_size}: model_type {model_type!r} has tensor-parallel styles twinkle cannot apply "
            f"({'; '.join(refused)}); supported styles are {', '.join(TRANSLATED_STYLES)}. Use tp_size=1 (FSDP "
            "shards the model; mixture-of-experts models: expert parallelism, ep_size)."]


def _hf_model(module: torch.nn.Module) -> torch.nn.Module:
    """The Transformers model inside a loss module and/or a PEFT wrapper."""
    model = getattr(module, "model", module)
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def _pattern(name: str) -> re.Pattern:
    return re.compile(re.escape(name).replace(r"\*", r"\d+"))


def _is_lora(module: torch.nn.Module) -> bool:
    return hasattr(module, "base_layer") and hasattr(module, "lora_A")


def _parallelize_lora(module: torch.nn.Module, style: str, mesh) -> None:
    """Shard a PEFT LoRA layer: the base as planned, the adapter matrices so the two outputs line up."""
    if getattr(module, "use_dora", {}) and any(module.use_dora.values()):
        raise ValueError("LoRA with use_dora=True under tensor parallelism is not supported; use plain LoRA "
                         "(use_dora=False) or tp_size=1.")
    if not isinstance(module.base_layer, torch.nn.Linear):
        raise ValueError(f"LoRA on a {type(module.base_layer).__name__} under tensor parallelism is not supported; "
                         "target linear layers only (e.g. target_modules='all-linear') or use tp_size=1.")
    parallelize_module(module.base_layer, mesh, _STYLES[style]())
    sharded = module.lora_B if style in _COLWISE else module.lora_A  # the matrix facing the sharded side
    for adapter in sharded.values():
        parallelize_module(adapter, mesh, _STYLES[style]())


class _SumGradOverGroup(torch.autograd.Function):
    """Identity forward; backward sums the incoming gradient over the group (before it is accumulated)."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def _sum_grads_over_tp(module: torch.nn.Module, mesh) -> None:
    """`replicated_with_grad_allreduce` (e.g. Qwen's per-head q/k norms): each rank sees only its heads, so the
    weights' gradients are partial; sum them as they are computed, which keeps accumulation exact and also
    holds for the unsharded parameters FSDP puts on the module during forward."""
    forward, group = module.forward, mesh.get_group()

    def summed_forward(*args, **kwargs):
        held = dict(module._parameters)
        for name, param in held.items():
            if param is not None and param.requires_grad and torch.is_grad_enabled():
                module._parameters[name] = _SumGradOverGroup.apply(param, group)
        try:
            return forward(*args, **kwargs)
        finally:
            module._parameters.update(held)

    module.forward = summed_forward


def _shared_parameters(model: torch.nn.Module) -> list[list[tuple[torch.nn.Module, str]]]:
    """(module, attribute) owners of each parameter held by more than one module (tied embeddings)."""
    owners: dict[int, list[tuple[torch.nn.Module, str]]] = {}
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            owners.setdefault(id(param), []).append((module, name))
    return [group for group in owners.values() if len(group) > 1]


def apply_tensor_parallel(module: torch.nn.Module, mesh) -> None:
    """Shard `module` (a loss module, PEFT model or Transformers model) in place over the 1-D tp `mesh`."""
    model = _hf_model(module)
    plan = dict(getattr(model, "_tp_plan", None) or {})
    problems = _plan_problems(plan, model.config.model_type, mesh.size())
    if problems:
        raise ValueError(problems[0])
    tied = _shared_parameters(model)
    for name, child in model.named_modules():
        style = next((s for pattern, s in plan.items() if _pattern(pattern).fullmatch(name)), None)
        if style is None:
            continue
        if style == _GRAD_ALLREDUCE:
            _sum_grads_over_tp(child, mesh)
        elif _is_lora(child):
            _parallelize_lora(child, style, mesh)
        else:
            parallelize_module(child, mesh, _STYLES[style]())
    for (first, first_name), *others in tied:  # re-tie: all owners use the first owner's (sharded) parameter
        for owner, attribute in others:
            owner.register_parameter(attribute, getattr(first, first_name))


def is_tensor_parallel(module: torch.nn.Module) -> bool:
    return any(isinstance(p, DTensor) for p in module.parameters())
