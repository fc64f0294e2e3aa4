"""MultiLoraMegatronModel: many tenants' LoRA adapters trained on one shared megatron-core base model.

    model = MultiLoraMegatronModel("hf://Qwen/Qwen2.5-7B", tp_size=2, max_loras=8, max_r=32)   # under torchrun
    for name in ("alice", "bob"):
        model.add_adapter_to_model(name, LoraConfig(r=8, target_modules="all-linear"))
        model.set_optimizer("AdamW", lr=2e-4, adapter_name=name)
        model.set_lr_scheduler("CosineWarmupScheduler", num_training_steps=100, adapter_name=name)
    model.forward_backward(inputs=alice_rows + bob_rows,                      # a mixed batch: one name per row,
                           adapter_name=["alice"] * 4 + ["bob"] * 4)           #   one base pass, losses per tenant
    model.clip_grad_and_step(adapter_name="alice")                            # steps alice only
    model.save("alice", "out/", adapter_name="alice")                         # a plain PEFT adapter directory

The verbs of multi-tenancy (tenants.py MultiTenant, the same for both backends) on MegatronModel's base (tp,
pp with 1F1B over micro-batches, sequence parallelism, data parallelism over what tp × pp leave). The
adapters live on megatron's parallel linears, split like their base weights (twinkle_core.megatron.lora);
each micro-batch's rows are routed to their tenants' adapters, so one pass of the frozen base serves every
tenant of a batch. Each tenant keeps its own fp32 adapter weights, torch optimizer, scheduler, accumulation,
step count and metrics (tenants.py, the Stepper), synchronised over megatron's groups by MegatronTenantSync:
a step of one tenant changes no other tenant's weights or optimizer state, nor the base. Every rank names
the same tenant(s) in each call.
"""
from __future__ import annotations

from pathlib import Path

import torch

from twinkle_core.convert.lora_peft import export_peft_adapter, load_peft_adapter, read_peft_config
from twinkle_core.megatron.engine import resolve_transformer_impl
from twinkle_core.megatron.lora import (LoraRowRouter, add_megatron_lora, adapter_parameters, check_lora_config,
                                        remove_megatron_lora)
from twinkle_core.megatron.step import run_schedule, split_micro_batches
from twinkle_core.megatron.tenant_sync import MegatronTenantSync
from twinkle_core.models.batches import count_input_tokens
from twinkle_core.models.megatron_model import MegatronModel, _barrier, _is_rank0, _megatron_precision
from twinkle_core.models.stepper import Stepper
from twinkle_core.models.tenants import MultiTenant, Tenant, TenantPart, TenantSlots
from twinkle_core.precision import MixedPrecision


class MultiLoraMegatronModel(MultiTenant, MegatronModel):
    """A Megatron-capable model with up to `max_loras` tenant LoRA adapters of rank <= `max_r`."""

    def __init__(self, model_id: str, mixed_precision: str = "auto", tp_size: int = 1, pp_size: int = 1,
                 ep_size: int = 1, sequence_parallel: bool = False, dp_size: int | None = None, micro_batch_size: int = 1,
                 max_length: int | None = None, seed: int = 0, max_loras: int = 8, max_r: int = 64,
                 transformer_impl: str | None = None):
        """`transformer_impl`: None or 'local' (the tenants' LoRA hooks the local spec's parallel linears)."""
        self.slots = TenantSlots(max_loras, max_r)  # checked before the model is built
        transformer_impl = resolve_transformer_impl(transformer_impl, lora=True)
        if _megatron_precision(mixed_precision).mode is MixedPrecision.fp16:
            raise ValueError("mixed_precision='fp16' is not supported for multi-tenant LoRA on megatron (each "
                             "tenant would need its own loss scaler inside one backward); use 'bf16' or 'no'.")
        super().__init__(model_id, mixed_precision, tp_size=tp_size, pp_size=pp_size, ep_size=ep_size,
                         sequence_parallel=sequence_parallel, dp_size=dp_size, micro_batch_size=micro_batch_size,
                         max_length=max_length, seed=seed, transformer_impl=transformer_impl)
        for chunk in self.chunks:
            chunk.requires_grad_(False)
        self.router = LoraRowRouter()  # no default adapter: every pass names its rows' tenants
        self.sync = MegatronTenantSync()

    # ----- the primitives MultiTenant composes: LoRA on megatron's parallel linears, routed per row block
    def _tenant_add(self, name: str, config, seed: int | None = None) -> None:
        """`seed`: the adapter's initialisation (default: the model's seed); its weights are fp32."""
        check_lora_config(config)
        try:
            for chunk in self.chunks:
                add_megatron_lora(chunk, config, name, router=self.router,
                                  seed=self.seed if seed is None else seed, dtype=torch.float32)
        except Exception:
            self._tenant_remove(name)
            raise

    def _tenant_load(self, name: str, source: Path) -> None:
        try:
            load_peft_adapter(self.chunks, self.hf_config, source, name, router=self.router, dtype=torch.float32)
        except Exception:
            self._tenant_remove(name)
            raise

    def _tenant_config(self, source: Path):
        return read_peft_config(source)

    def _tenant_remove(self, name: str) -> None:
        for chunk in self.chunks:
            remove_megatron_lora(chunk, name)

    def _tenants_changed(self) -> None:
        """Nothing to do: megatron's LoRA layers route through `self.router` from the start."""

    def _tenant_parameters(self, name: str) -> list[torch.nn.Parameter]:
        return [p for chunk in self.chunks for p in adapter_parameters(chunk, name)]

    def _tenant_stepper(self, tenant: Tenant, optimizer_cls: type, lr: float, kw: dict) -> Stepper:
        params = self._tenant_parameters(tenant.name)
        optimizer = optimizer_cls(params, lr=lr, **{"weight_decay": 0.0, **kw})
        return Stepper(params, optimizer, tenant.gradient_accumulation_steps, parallel=self.sync)

    def _set_train_mode(self, training: bool) -> None:
        for chunk in self.chunks:
            chunk.train(training)

    def _tenant_pass(self, batch: dict, names: list[str], order: list[str], steppers: list[Stepper] | None
                     ) -> list[TenantPart]:
        """This rank's rows in micro-batches through megatron's schedule (backward inside it when training)."""
        pad = self.layout.tp if self.layout.sequence_parallel else 1
        micro_batches = split_micro_batches(batch, self.micro_batch_size, pad_multiple=pad, row_adapters=names,
                                            allow_ragged=self.layout.pp == 1)
        _, _, sums = run_schedule(self.chunks, micro_batches, self.hf_config.vocab_size,
                                  forward_only=steppers is None, router=self.router, tenants=order)
        parts = []
        for name, (loss_sum, tokens) in zip(order, sums):
            rows = [i for i, n in enumerate(names) if n == name]
            seen = count_input_tokens({k: v[rows] for k, v in batch.items() if k in ("input_ids", "attention_mask")})
            parts.append(TenantPart(torch.tensor(loss_sum), loss_sum, tokens, seen))
        return parts

    def _tenant_save(self, tenant: Tenant, target: Path) -> Path:
        export_peft_adapter(self.chunks, self.hf_config, tenant.config, target, tenant.name)
        if _is_rank0():
            self.tokenizer.save_pretrained(str(target))
        _barrier()
        return target

    def _tenants_anywhere(self, local: set[str]) -> set[str]:
        """The tenants with rows on any data-parallel rank."""
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        if self.data_parallel_size == 1:
            return local
        gathered: list = [None] * self.data_parallel_size
        dist.all_gather_object(gathered, sorted(local), group=ps.get_data_parallel_group())
        return set().union(*map(set, gathered))

    def _sum_over_data_parallel(self, values: list[float]) -> list[float]:
        return self.sync.all_reduce_sum(values)
