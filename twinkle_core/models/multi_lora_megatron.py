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

The verbs of MultiLoraTransformersModel on MegatronModel's base (tp, pp with 1F1B over micro-batches,
sequence parallelism, data parallelism over what tp × pp leave). The adapters live on megatron's parallel
linears, split like their base weights (twinkle_core.megatron.lora); each micro-batch's rows are routed to
their tenants' adapters, so one pass of the frozen base serves every tenant of a batch. Each tenant keeps
its own fp32 adapter weights, torch optimizer, scheduler, accumulation, step count and metrics (tenants.py,
the Stepper), synchronised over megatron's groups by MegatronTenantSync: a step of one tenant changes no
other tenant's weights or optimizer state, nor the base. Every rank names the same tenant(s) in each call.
"""
from __future__ import annotations

import copy
from pathlib import Path

import torch

from twinkle_core.convert.lora_peft import export_peft_adapter, load_peft_adapter, read_peft_config
from twinkle_core.megatron.lora import (LoraRowRouter, add_megatron_lora, adapter_parameters, check_lora_config,
                                        remove_megatron_lora)
from twinkle_core.megatron.step import run_schedule, split_micro_batches
from twinkle_core.megatron.tenant_sync import MegatronTenantSync
from twinkle_core.models.batches import count_input_tokens, to_batch
from twinkle_core.models.megatron_model import MegatronModel, _barrier, _is_rank0, _megatron_precision
from twinkle_core.models.stepper import Stepper, optimizer_class
from twinkle_core.models.tenants import Tenant, TenantSlots, TenantVerbs
from twinkle_core.precision import MixedPrecision


class MultiLoraMegatronModel(TenantVerbs, MegatronModel):
    """A Megatron-capable model with up to `max_loras` tenant LoRA adapters of rank <= `max_r`."""

    def __init__(self, model_id: str, mixed_precision: str = "auto", tp_size: int = 1, pp_size: int = 1,
                 ep_size: int = 1, sequence_parallel: bool = False, dp_size: int | None = None, micro_batch_size: int = 1,
                 max_length: int | None = None, seed: int = 0, max_loras: int = 8, max_r: int = 64):
        self.slots = TenantSlots(max_loras, max_r)  # checked before the model is built
        if _megatron_precision(mixed_precision).mode is MixedPrecision.fp16:
            raise ValueError("mixed_precision='fp16' is not supported for multi-tenant LoRA on megatron (each "
                             "tenant would need its own loss scaler inside one backward); use 'bf16' or 'no'.")
        super().__init__(model_id, mixed_precision, tp_size=tp_size, pp_size=pp_size, ep_size=ep_size,
                         sequence_parallel=sequence_parallel, dp_size=dp_size, micro_batch_size=micro_batch_size,
                         max_length=max_length, seed=seed)
        for chunk in self.chunks:
            chunk.requires_grad_(False)
        self.router = LoraRowRouter()  # no default adapter: every pass names its rows' tenants
        self.sync = MegatronTenantSync()

    # ----- tenants ---------------------------------------------------------------------------------
    def add_adapter_to_model(self, name: str, config, gradient_accumulation_steps: int = 1,
                             seed: int | None = None) -> None:
        """Add tenant `name`'s adapter (fp32 weights; `seed`: its initialisation, default the model's seed)."""
        config = copy.deepcopy(config)
        self.slots.check_new(name, config)
        check_lora_config(config)
        if not isinstance(gradient_accumulation_steps, int) or gradient_accumulation_steps < 1:
            raise ValueError(f"gradient_accumulation_steps={gradient_accumulation_steps!r} must be an integer >= 1.")
        try:
            for chunk in self.chunks:
                add_megatron_lora(chunk, config, name, router=self.router,
                                  seed=self.seed if seed is None else seed, dtype=torch.float32)
        except Exception:
            self._take_off(name)
            raise
        self.slots.add(Tenant(name, config, gradient_accumulation_steps))

    def remove_adapter(self, name: str) -> None:
        """Delete tenant `name`: its adapter weights, optimizer state and metrics; its slot is free again."""
        self.slots.get(name, "remove_adapter")
        self._take_off(name)
        self.slots.remove(name)

    def _take_off(self, name: str) -> None:
        for chunk in self.chunks:
            remove_megatron_lora(chunk, name)

    def tenant_parameters(self, name: str) -> list[torch.nn.Parameter]:
        """Tenant `name`'s adapter weights on this rank (its tp shards, its pipeline stage's layers)."""
        self.slots.get(name, "tenant_parameters")
        return [p for chunk in self.chunks for p in adapter_parameters(chunk, name)]

    # ----- optimisation ----------------------------------------------------------------------------
    def set_optimizer(self, optimizer_cls: str | type = "AdamW", lr: float = 1e-4,
                      gradient_accumulation_steps: int | None = None, *, adapter_name: str,
                      weight_decay: float = 0.0, **kw) -> None:
        """Give tenant `adapter_name` its own torch optimizer over its own adapter weights."""
        tenant = self.slots.get(adapter_name, "set_optimizer")
        if gradient_accumulation_steps is not None:
            tenant.gradient_accumulation_steps = gradient_accumulation_steps
        params = self.tenant_parameters(adapter_name)
        optimizer = optimizer_class(optimizer_cls)(params, lr=lr, weight_decay=weight_decay, **kw)
        tenant.stepper = Stepper(params, optimizer, tenant.gradient_accumulation_steps, parallel=self.sync)

    def forward_backward(self, inputs: list[dict] | dict, *, adapter_name: str | list[str]) -> float | dict[str, float]:
        """Forward and backward this rank's rows of one tenant (a name) or several (one name per row), in
        micro-batches through megatron's schedule; the mean token loss, per tenant for a list of names."""
        for chunk in self.chunks:
            chunk.train()
        batch, names, order = self._sorted_batch(inputs, adapter_name, "forward_backward")
        steppers = [self._stepper(name, "forward_backward") for name in order]
        for stepper in steppers:
            stepper.start_micro_batch()
        _, _, sums = run_schedule(self.chunks, self._split(batch, names), self.hf_config.vocab_size,
                                  forward_only=False, router=self.router, tenants=order)
        for name, stepper, (loss_sum, tokens) in zip(order, steppers, sums):
            rows = [i for i, n in enumerate(names) if n == name]
            seen = count_input_tokens({k: v[rows] for k, v in batch.items() if k in ("input_ids", "attention_mask")})
            stepper.record(torch.tensor(loss_sum), tokens, seen)
        return self._per_tenant(adapter_name, order, sums)

    @torch.no_grad()
    def forward_only(self, inputs: list[dict] | dict, *, adapter_name: str | list[str]) -> float | dict[str, float]:
        """Evaluation forward; accumulates each tenant's held-out loss for calculate_metric(False, ...)."""
        for chunk in self.chunks:
            chunk.eval()
        batch, names, order = self._sorted_batch(inputs, adapter_name, "forward_only")
        _, _, sums = run_schedule(self.chunks, self._split(batch, names), self.hf_config.vocab_size,
                                  forward_only=True, router=self.router, tenants=order)
        for name, (loss_sum, tokens) in zip(order, sums):
            tenant = self.slots.get(name, "forward_only")
            tenant.eval_sums[0] += loss_sum
            tenant.eval_sums[1] += tokens
        return self._per_tenant(adapter_name, order, sums)

    # ----- checkpoints -----------------------------------------------------------------------------
    def save(self, name: str, output_dir: str | Path, *, adapter_name: str) -> Path:
        """Write `output_dir/name`: tenant `adapter_name`'s adapter as a plain PEFT directory of the HF model
        (+ tokenizer); it loads on the HF base with `PeftModel.from_pretrained`. Every rank calls it."""
        tenant = self.slots.get(adapter_name, "save")
        target = Path(output_dir) / name
        export_peft_adapter(self.chunks, self.hf_config, tenant.config, target, adapter_name)
        if _is_rank0():
            self.tokenizer.save_pretrained(str(target))
        _barrier()
        return target

    def load(self, name: str, output_dir: str | Path, *, adapter_name: str | None = None) -> None:
        """Add the PEFT adapter directory `output_dir/name` as tenant `adapter_name` (default: `name`)."""
        adapter_name = adapter_name or name
        source = Path(output_dir) / name
        config = read_peft_config(source)
        self.slots.check_new(adapter_name, config)
        try:
            load_peft_adapter(self.chunks, self.hf_config, source, adapter_name, router=self.router,
                              dtype=torch.float32)
        except Exception:
            self._take_off(adapter_name)
            raise
        self.slots.add(Tenant(adapter_name, config))

    # ----- helpers ---------------------------------------------------------------------------------
    def _sum_over_data_parallel(self, values: list[float]) -> list[float]:
        return self.sync.all_reduce_sum(values)

    def _sorted_batch(self, inputs, adapter_name: str | list[str], verb: str):
        """The device batch with rows in tenant order, each row's tenant, and the call's tenants (in slot order,
        the union over data-parallel ranks, so every rank counts the same tenants' micro-batches)."""
        batch = to_batch(inputs, self.tokenizer, self.device, self.max_length)
        rows = batch["input_ids"].shape[0]
        if isinstance(adapter_name, str):
            names = [adapter_name] * rows
        elif isinstance(adapter_name, (list, tuple)) and len(adapter_name) == rows:
            names = list(adapter_name)
        else:
            raise ValueError(f"{verb}: adapter_name must be a tenant name or a list with one name per row "
                             f"({rows} rows), got {adapter_name!r}.")
        for name in set(names):
            self.slots.get(name, verb)
        order = self._tenants_in_call(set(names))
        permutation = sorted(range(rows), key=lambda i: order.index(names[i]))
        if permutation != list(range(rows)):
            index = torch.tensor(permutation, device=self.device)
            batch = {k: v.index_select(0, index) for k, v in batch.items()}
            names = [names[i] for i in permutation]
        return batch, names, order

    def _tenants_in_call(self, local: set[str]) -> list[str]:
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        if self.data_parallel_size > 1:
            gathered: list = [None] * self.data_parallel_size
            dist.all_gather_object(gathered, sorted(local), group=ps.get_data_parallel_group())
            local = set().union(*map(set, gathered))
        return [name for name in self.slots.names() if name in local]

    def _split(self, batch: dict, names: list[str]):
        pad = self.layout.tp if self.layout.sequence_parallel else 1
        return split_micro_batches(batch, self.micro_batch_size, pad_multiple=pad, row_adapters=names,
                                   allow_ragged=self.layout.pp == 1)

    @staticmethod
    def _per_tenant(adapter_name, order: list[str], sums: list) -> float | dict[str, float]:
        means = {name: loss / max(1, tokens) for name, (loss, tokens) in zip(order, sums)}
        return means[adapter_name] if isinstance(adapter_name, str) else means
