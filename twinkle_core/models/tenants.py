"""The tenants of a multi-LoRA model: each one's adapter config and training state, and the slot rules.

A tenant owns everything that makes its training its own: its Stepper (optimizer and its state,
scheduler, gradient accumulation, grad scaler, step count, last metrics) and its held-out loss sums.
Nothing here is shared between tenants, so one tenant's step cannot touch another's state.

`TenantSlots` admits a new adapter only if it fits (`max_loras` adapters, rank <= `max_r`) and is a plain
LoRA whose rows can be routed (no DoRA, no trained biases or extra modules, which would be shared by every
tenant); it checks everything before the model changes, so a refused adapter leaves the model as it was.
"""
from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from peft import LoraConfig

from twinkle_core.models.batches import to_batch
from twinkle_core.models.schedulers import build_scheduler
from twinkle_core.models.stepper import Stepper, check_accumulation, held_out_metrics, optimizer_class
from twinkle_core.models.tenant_state import load_tenant_states, save_tenant_states

_NAME = re.compile(r"^[A-Za-z0-9_-]+$")
_OWNER = re.compile(r"\.lora_(?:A|B)\.([^.]+)\.")


def adapter_of(parameter_name: str) -> str | None:
    """The adapter a parameter belongs to ('…q_proj.lora_A.<adapter>.weight'), None for base weights."""
    match = _OWNER.search(parameter_name)
    return match.group(1) if match else None


@dataclass
class Tenant:
    name: str
    config: LoraConfig
    gradient_accumulation_steps: int = 1
    stepper: Stepper | None = None
    eval_sums: list = field(default_factory=lambda: [0.0, 0])  # summed held-out loss, tokens

    def training_metrics(self) -> dict[str, float]:
        """The last step's loss, grad_norm, lr, tokens_per_s and step ({} before the first step)."""
        last = self.stepper.last if self.stepper else None
        return {} if last is None else last.as_metrics()

    def eval_metrics(self, all_reduce_sum) -> dict[str, float]:
        """Held-out loss and perplexity over every data-parallel rank's forward_only batches; resets them."""
        loss_sum, tokens = all_reduce_sum(self.eval_sums)
        self.eval_sums = [0.0, 0]
        return held_out_metrics(loss_sum, tokens)


class TenantSlots:
    """Up to `max_loras` named tenants with LoRA rank at most `max_r`."""

    def __init__(self, max_loras: int, max_r: int):
        for option, value in (("max_loras", max_loras), ("max_r", max_r)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{option}={value!r} must be an integer >= 1.")
        self.max_loras, self.max_r = max_loras, max_r
        self.tenants: dict[str, Tenant] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.tenants

    def names(self) -> list[str]:
        return list(self.tenants)

    def get(self, name: str, verb: str) -> Tenant:
        if not isinstance(name, str) or name not in self.tenants:
            known = ", ".join(self.tenants) or "none yet"
            raise ValueError(f"{verb}: adapter_name={name!r} is not on this model (adapters: {known}); "
                             "add it with add_adapter_to_model(name, LoraConfig(...)) or load(...) first.")
        return self.tenants[name]

    def check_new(self, name: str, config: LoraConfig) -> None:
        """Raise, naming the option and what would fit, unless `name` with `config` can be added now."""
        if not isinstance(name, str) or not _NAME.match(name) or name == "__base__":
            raise ValueError(f"adapter name {name!r}: use letters, digits, '_' or '-' (it becomes part of "
                             "parameter names), and not '__base__'.")
        if name in self.tenants:
            raise ValueError(f"adapter {name!r} is already on this model; remove_adapter({name!r}) first or "
                             "choose another name.")
        if len(self.tenants) >= self.max_loras:
            raise ValueError(f"add_adapter_to_model({name!r}): the model already holds max_loras={self.max_loras} "
                             f"adapters ({', '.join(self.tenants)}); remove_adapter(name) one of them first, or "
                             f"create the model with max_loras >= {len(self.tenants) + 1}.")
        if not isinstance(config, LoraConfig):
            raise ValueError(f"adapter {name!r}: expected a peft.LoraConfig, got {type(config).__name__}.")
        if config.r > self.max_r:
            raise ValueError(f"adapter {name!r}: LoraConfig.r={config.r} exceeds max_r={self.max_r}; use r <= "
                             f"{self.max_r} or create the model with max_r >= {config.r}.")
        shared = {"bias": config.bias != "none", "modules_to_save": bool(config.modules_to_save),
                  "use_dora": bool(config.use_dora), "trainable_token_indices": bool(config.trainable_token_indices)}
        refused = [option for option, is_set in shared.items() if is_set]
        if refused:
            raise ValueError(f"adapter {name!r}: LoraConfig option(s) {refused} are not supported for multi-tenant "
                             "LoRA (they train weights every tenant shares, or need their own forward); use a plain "
                             "LoRA (bias='none', no modules_to_save, use_dora=False).")

    def add(self, tenant: Tenant) -> None:
        self.tenants[tenant.name] = tenant

    def remove(self, name: str) -> Tenant:
        return self.tenants.pop(name)


@dataclass
class TenantPart:
    """One tenant's share of a pass: its summed loss (a tensor for the stepper, and as a number), trained
    tokens, seen input tokens and router aux loss."""

    loss_sum: torch.Tensor
    loss: float
    num_tokens: int
    seen_tokens: int
    aux_loss: torch.Tensor | None = None


class MultiTenant:
    """Multi-tenancy as one component over a backend model: the tenant slots, each tenant's stepper, its
    verbs with the tenant named (`adapter_name=`), and the mixed batch sorted into tenant blocks.

    A backend composes it (`class MultiLoraXModel(MultiTenant, XModel)`) and gives it primitives only:
    `_tenant_add` / `_tenant_load` (put an adapter on its layers, or leave them as they were and raise),
    `_tenant_remove`, `_tenant_parameters`, `_tenant_stepper` (an optimizer over the tenant's weights),
    `_tenant_pass` (one pass of a tenant-sorted batch: each tenant's TenantPart; backward too when given
    the steppers), `_tenant_save`, `_tenant_config`, `_tenants_changed`, `_set_train_mode`,
    `_tenants_anywhere` (the union of the tenants over data-parallel ranks) and `_sum_over_data_parallel`.
    """

    slots: TenantSlots

    # ----- tenants ---------------------------------------------------------------------------------
    def add_adapter_to_model(self, name: str, config: LoraConfig, gradient_accumulation_steps: int = 1,
                             **backend_options) -> None:
        """Add tenant `name`'s LoRA adapter (its own rank, alpha, targets, dropout); refused ones change nothing."""
        config = copy.deepcopy(config)  # the defaults a backend fills in stay out of the caller's object
        self.slots.check_new(name, config)
        check_accumulation(gradient_accumulation_steps)
        self._tenant_add(name, config, **backend_options)
        self.slots.add(Tenant(name, config, gradient_accumulation_steps))
        self._tenants_changed()

    def remove_adapter(self, name: str) -> None:
        """Delete tenant `name`: its adapter weights, optimizer state and metrics; its slot is free again."""
        self.slots.get(name, "remove_adapter")
        self._tenant_remove(name)
        self.slots.remove(name)
        self._tenants_changed()

    def adapter_names(self) -> list[str]:
        return self.slots.names()

    def save_training_state(self, checkpoint_dir: str | Path, progress: dict, keep: int = 2) -> Path:
        """Every tenant's adapter, optimizer, schedule and step, with this rank's RNG (models.tenant_state)."""
        return save_tenant_states(self._steppers("save_training_state"), checkpoint_dir, progress, keep)

    def load_training_state(self, checkpoint_dir: str | Path, settings: dict) -> dict | None:
        """Restore every tenant from the newest intact state; its progress record (None: nothing saved)."""
        return load_tenant_states(self._steppers("load_training_state"), checkpoint_dir, settings)

    def _steppers(self, verb: str) -> dict[str, Stepper]:
        return {name: self._stepper(name, verb) for name in self.slots.names()}

    def tenant_parameters(self, name: str) -> list[torch.nn.Parameter]:
        """Tenant `name`'s adapter weights on this rank (its shards under FSDP or tp, its pipeline stage's)."""
        self.slots.get(name, "tenant_parameters")
        return self._tenant_parameters(name)

    # ----- optimisation ----------------------------------------------------------------------------
    def set_optimizer(self, optimizer_cls: str | type = "AdamW", lr: float = 1e-4,
                      gradient_accumulation_steps: int | None = None, *, adapter_name: str, **kw) -> None:
        """Give tenant `adapter_name` its own optimizer over its own adapter weights (`kw` go to the class)."""
        tenant = self.slots.get(adapter_name, "set_optimizer")
        if gradient_accumulation_steps is not None:
            tenant.gradient_accumulation_steps = check_accumulation(gradient_accumulation_steps)
        tenant.stepper = self._tenant_stepper(tenant, optimizer_class(optimizer_cls), lr, kw)

    def set_lr_scheduler(self, scheduler_cls: str = "CosineWarmupScheduler", num_warmup_steps: int = 0,
                         num_training_steps: int = 1, *, adapter_name: str) -> None:
        stepper = self._stepper(adapter_name, "set_lr_scheduler")
        stepper.scheduler = build_scheduler(stepper.optimizer, scheduler_cls, num_warmup_steps, num_training_steps)

    def forward_backward(self, inputs: list[dict] | dict, *, adapter_name: str | list[str]) -> float | dict[str, float]:
        """Forward and backward this rank's rows of one tenant (a name) or several (one name per row) in one
        pass of the base; the mean token loss, per tenant ({tenant: loss}) for a list of names."""
        self._set_train_mode(True)
        batch, names, order = self._sorted_batch(inputs, adapter_name, "forward_backward")
        steppers = [self._stepper(name, "forward_backward") for name in order]
        for stepper in steppers:
            stepper.start_micro_batch()
        parts = self._tenant_pass(batch, names, order, steppers)
        for stepper, part in zip(steppers, parts):
            stepper.record(part.loss_sum, part.num_tokens, part.seen_tokens, part.aux_loss)
        return self._per_tenant(adapter_name, order, parts)

    @torch.no_grad()
    def forward_only(self, inputs: list[dict] | dict, *, adapter_name: str | list[str]) -> float | dict[str, float]:
        """Evaluation forward; accumulates each tenant's held-out loss for calculate_metric(False, ...)."""
        self._set_train_mode(False)
        batch, names, order = self._sorted_batch(inputs, adapter_name, "forward_only")
        parts = self._tenant_pass(batch, names, order, None)
        for name, part in zip(order, parts):
            tenant = self.slots.get(name, "forward_only")
            tenant.eval_sums[0] += part.loss
            tenant.eval_sums[1] += part.num_tokens
        return self._per_tenant(adapter_name, order, parts)

    def clip_grad_and_step(self, max_grad_norm: float | None = 1.0, *, adapter_name: str) -> bool:
        """Step tenant `adapter_name` when its accumulation boundary is reached; return whether it stepped."""
        stepper = self._stepper(adapter_name, "clip_grad_and_step")
        if not stepper.is_accumulation_boundary():
            return False
        stepper.clip_and_step(max_grad_norm)
        return True

    def calculate_metric(self, is_training: bool = True, *, adapter_name: str) -> dict[str, float]:
        """Tenant `adapter_name`'s last step (training) or held-out loss and perplexity so far (eval)."""
        tenant = self.slots.get(adapter_name, "calculate_metric")
        if not is_training:
            return tenant.eval_metrics(self._sum_over_data_parallel)
        self._stepper(adapter_name, "calculate_metric")
        return tenant.training_metrics()

    # ----- checkpoints -----------------------------------------------------------------------------
    def save(self, name: str, output_dir: str | Path, *, adapter_name: str) -> Path:
        """Write `output_dir/name`: tenant `adapter_name`'s adapter as a plain PEFT directory of the HF model
        (+ tokenizer); it loads on the HF base with `PeftModel.from_pretrained`. Every rank calls it."""
        tenant = self.slots.get(adapter_name, "save")
        return self._tenant_save(tenant, Path(output_dir) / name)

    def load(self, name: str, output_dir: str | Path, *, adapter_name: str | None = None) -> None:
        """Add the PEFT adapter directory `output_dir/name` as tenant `adapter_name` (default: `name`)."""
        adapter_name = adapter_name or name
        source = Path(output_dir) / name
        config = self._tenant_config(source)
        self.slots.check_new(adapter_name, config)
        self._tenant_load(adapter_name, source)
        self.slots.add(Tenant(adapter_name, config))
        self._tenants_changed()

    # ----- the shared parts of the verbs -----------------------------------------------------------
    def _sorted_batch(self, inputs, adapter_name: str | list[str], verb: str
                      ) -> tuple[dict[str, torch.Tensor], list[str], list[str]]:
        """The device batch with its rows in tenant order, each row's tenant, and the call's tenants: in slot
        order, the union over data-parallel ranks (a tenant may have no rows on some rank)."""
        batch = to_batch(inputs, self.tokenizer, self.device, self.max_length)
        rows = batch["input_ids"].shape[0]
        if isinstance(adapter_name, str):
            self.slots.get(adapter_name, verb)
            return batch, [adapter_name] * rows, [adapter_name]  # every rank names the same tenant
        if not isinstance(adapter_name, (list, tuple)) or not adapter_name:
            raise ValueError(f"{verb}: adapter_name must be a tenant name or a list with one name per row, "
                             f"got {adapter_name!r}.")
        if len(adapter_name) != rows:
            raise ValueError(f"{verb}: {len(adapter_name)} adapter names for {rows} rows; give one name per row "
                             "(or one name for the whole batch).")
        for name in set(adapter_name):
            self.slots.get(name, verb)
        anywhere = self._tenants_anywhere(set(adapter_name))
        order = [name for name in self.slots.names() if name in anywhere]
        permutation = sorted(range(rows), key=lambda i: order.index(adapter_name[i]))
        names = [adapter_name[i] for i in permutation]
        if permutation != list(range(rows)):
            index = torch.tensor(permutation, device=batch["input_ids"].device)
            batch = {k: v.index_select(0, index) for k, v in batch.items()}
        return batch, names, order

    def _stepper(self, name: str, verb: str) -> Stepper:
        tenant = self.slots.get(name, verb)
        if tenant.stepper is None:
            raise RuntimeError(f"{verb}: call set_optimizer(..., adapter_name={name!r}) first.")
        return tenant.stepper

    @staticmethod
    def _per_tenant(adapter_name: str | list[str], order: list[str], parts: list[TenantPart]
                    ) -> float | dict[str, float]:
        means = {name: part.loss / max(1, part.num_tokens) for name, part in zip(order, parts)}
        return means[adapter_name] if isinstance(adapter_name, str) else means
