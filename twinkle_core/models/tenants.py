"""The tenants of a multi-LoRA model: each one's adapter config and training state, and the slot rules.

A tenant owns everything that makes its training its own: its Stepper (optimizer and its state,
scheduler, gradient accumulation, grad scaler, step count, last metrics) and its held-out loss sums.
Nothing here is shared between tenants, so one tenant's step cannot touch another's state.

`TenantSlots` admits a new adapter only if it fits (`max_loras` adapters, rank <= `max_r`) and is a plain
LoRA whose rows can be routed (no DoRA, no trained biases or extra modules, which would be shared by every
tenant); it checks everything before the model changes, so a refused adapter leaves the model as it was.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from peft import LoraConfig

from twinkle_core.models.schedulers import build_scheduler
from twinkle_core.models.stepper import Stepper, held_out_metrics

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


class TenantVerbs:
    """The tenant-keyed verbs every multi-tenant model shares (it has `slots` and `_sum_over_data_parallel`)."""

    slots: TenantSlots

    def _sum_over_data_parallel(self, values: list[float]) -> list[float]:
        raise NotImplementedError

    def adapter_names(self) -> list[str]:
        return self.slots.names()

    def set_lr_scheduler(self, scheduler_cls: str = "CosineWarmupScheduler", num_warmup_steps: int = 0,
                         num_training_steps: int = 1, *, adapter_name: str) -> None:
        stepper = self._stepper(adapter_name, "set_lr_scheduler")
        stepper.scheduler = build_scheduler(stepper.optimizer, scheduler_cls, num_warmup_steps, num_training_steps)

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

    def _stepper(self, name: str, verb: str) -> Stepper:
        tenant = self.slots.get(name, verb)
        if tenant.stepper is None:
            raise RuntimeError(f"{verb}: call set_optimizer(..., adapter_name={name!r}) first.")
        return tenant.stepper
