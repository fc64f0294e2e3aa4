"""Route each row of a batch to its tenant's LoRA adapter: grouped per-adapter matmuls in every LoRA layer.

Several tenants' PEFT adapters live side by side on one PeftModel. PEFT itself applies the *active*
adapters to every row, and its per-row `adapter_names` mode is refused in training mode at the model
level and only touches the adapters present in the local rows. Under FSDP every data-parallel rank must
produce gradients for the same parameters (each rank's reduce-scatter covers the parameters that have a
gradient), so a tenant whose rows all landed on another rank must still take part, with no rows.

So the routing is ours, installed once as two hooks on every PEFT LoRA linear layer:
- a forward pre-hook passes PEFT's own per-row argument `adapter_names=["__base__", ...]`, which makes
  the layer compute the frozen base projection only (documented PEFT behaviour, requires_grad untouched);
- a forward hook adds, for each (tenant, rows) group, `B(A(dropout(x[rows]))) * scaling` of that
  tenant's adapter: the rows of one tenant are contiguous, so `x[rows]` is a view, and the deltas of all
  groups are concatenated in row order and added once. A group with no rows still runs its (empty)
  matmuls, which gives its tenant defined, zero gradients on this rank.
- a padding-free batch (one row of samples end to end) is routed the same way along its tokens
  (`route(groups, axis=1)`): a group is then a span of tokens, each tenant's samples lying together.

With one group covering every row this is exactly PEFT's own LoRA forward (same ops, same order), so a
tenant trains bit-for-bit like a single adapter on TransformersModel. Outside `route(...)` a forward
fails: a multi-tenant model has no meaningful "default" adapter.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator

import torch
from peft.tuners.lora.layer import Linear as LoraLinear

BASE_ONLY = "__base__"  # PEFT's per-row name for "no adapter on this row"


@dataclass(frozen=True)
class RowGroup:
    """Rows `start:stop` of the batch use `adapter` (stop None: to the end); tokens, when routed along axis 1."""

    adapter: str
    start: int = 0
    stop: int | None = None

    @property
    def rows(self) -> slice:
        return slice(self.start, self.stop)


class LoraRouter:
    """Holds the current row groups and applies them in every PEFT LoRA linear layer of a model."""

    def __init__(self):
        self._groups: tuple[RowGroup, ...] | None = None
        self._axis = 0
        self._hooked: set[int] = set()
        self._handles: list = []

    def attach(self, model: torch.nn.Module) -> None:
        """Hook every LoRA linear layer of `model` not hooked yet (call after adding an adapter)."""
        for module in model.modules():
            if isinstance(module, LoraLinear) and id(module) not in self._hooked:
                self._handles.append(module.register_forward_pre_hook(self._base_only, with_kwargs=True))
                self._handles.append(module.register_forward_hook(self._add_tenant_deltas, with_kwargs=True))
                self._hooked.add(id(module))

    @contextlib.contextmanager
    def route(self, groups: list[RowGroup] | tuple[RowGroup, ...], axis: int = 0) -> Iterator[None]:
        """Forwards inside this context send each group's rows (axis 0) or tokens (axis 1: a padding-free row)
        through its own adapter."""
        previous, self._groups = (self._groups, self._axis), tuple(groups)
        self._axis = axis
        try:
            yield
        finally:
            self._groups, self._axis = previous

    def _base_only(self, module: LoraLinear, args: tuple, kwargs: dict):
        if self._groups is None:
            raise RuntimeError("a multi-tenant LoRA model ran without naming the adapter of its rows: use "
                               "MultiLoraTransformersModel's verbs with adapter_name=, or `with model.adapter(name):`.")
        kwargs["adapter_names"] = [BASE_ONLY] * args[0].shape[0]
        return args, kwargs

    def _add_tenant_deltas(self, module: LoraLinear, args: tuple, kwargs: dict, output: torch.Tensor) -> torch.Tensor:
        x = args[0]
        deltas, adapted = [], False
        span = (slice(None),) * self._axis  # rows, or tokens of every row
        for group in self._groups:
            rows = x[(*span, group.rows)]
            if group.adapter in module.lora_A:
                lora_a, lora_b = module.lora_A[group.adapter], module.lora_B[group.adapter]
                rows = rows.to(lora_a.weight.dtype)
                delta = lora_b(lora_a(module.lora_dropout[group.adapter](rows))) * module.scaling[group.adapter]
                adapted = True
            else:  # this tenant does not adapt this layer
                delta = output.new_zeros((*rows.shape[:-1], output.shape[-1]))
            deltas.append(delta)
        if not adapted:
            return output
        delta = deltas[0] if len(deltas) == 1 else torch.cat([d.to(output.dtype) for d in deltas], dim=self._axis)
        return (output + delta).to(output.dtype)
