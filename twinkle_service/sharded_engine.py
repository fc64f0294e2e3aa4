"""The service's engine on the Transformers backend with the base sharded by FSDP2 (`--fsdp`).

    python -m flows.service --fsdp --nproc-per-node 8       # each worker holds 1/8 of every layer

FSDP shards parameters when it wraps the model, and tenants come and go while the server runs, so the
adapters are there before the wrap: `--max-tenants` slots of rank `--max-lora-rank` on every LoRA layer,
sharded with their layers. A tenant takes a free slot (the slot's adapter is renamed to the tenant's name,
so the router and everything else address it as on the replicated engine) and uses its first `rank` rows
of A and columns of B; the rest stay zero, their gradients are exactly zero (each is multiplied by the
other's zeros) and so AdamW leaves them at zero: a slot of rank 64 trains exactly like a rank-r adapter.
The scale is alpha/r of the tenant's rank, and its initial weights are drawn as PEFT draws a rank-r
adapter of the same seed (so `--fsdp` trains like the replicated engine; tested).

Every rank takes part in every forward and backward (FSDP all-gathers each layer and reduce-scatters its
gradients): a rank without rows of a pass runs a copy of one with its loss inputs zeroed, and a tenant
without rows on a rank still runs its (empty) matmuls, so all ranks reduce the same gradients. Training
and forward-only requests of a pass run as separate passes (only the former run backward). FSDP averages
the ranks' gradients; each step multiplies them back by the number of ranks (Tinker's losses are sums).
Memory: every slot is allocated at start
(max_tenants x max_lora_rank per LoRA layer, 1/N of it per worker).
"""
from __future__ import annotations

import math
from pathlib import Path

import torch
from peft import LoraConfig
from peft.tuners.lora.layer import Linear as LoraLinear
from safetensors.torch import load_file, save_file

from twinkle_core.errors import UserError
from twinkle_core.models.tenants import Tenant
from twinkle_core.parallel.strategy import norm_as_float
from twinkle_service.engine import _rank_and_world
from twinkle_service.transformers_engine import TransformersEngine

FREE = "slot"  # a free slot's adapter name: slot0, slot1, ...
ADAPTER_WEIGHTS = "adapter_model.safetensors"


class ShardedEngine(TransformersEngine):
    every_rank_runs = True
    chunked_head = False  # FSDP gathers the output layer's weight only inside the root module's forward

    def __init__(self, model_id: str, max_tenants: int = 8, max_rank: int = 64, max_length: int = 4096,
                 mixed_precision: str = "auto"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        from twinkle_core.parallel.fsdp import decoder_layers, mixed_precision_policy

        super().__init__(model_id, max_tenants, max_rank, max_length, mixed_precision)
        self.model.padding_free = False  # rows padded: the router's empty row groups
        self.max_rank = max_rank
        config = LoraConfig(r=max_rank, lora_alpha=max_rank, lora_dropout=0.0)
        for slot in range(max_tenants):
            self.model.add_adapter_to_model(f"{FREE}{slot}", config)
        self.model.slots.tenants.clear()  # the slots are the engine's; the model's tenants are the sessions'
        for name, param in self.model.model.named_parameters():
            param.requires_grad_(".lora_" in name)
        self.model.model.eval()
        _, world = _rank_and_world()
        mesh = init_device_mesh(self.device.type, (world,))
        kwargs = dict(mesh=mesh, mp_policy=mixed_precision_policy(self.model.precision))
        root = self.model.model
        for layer in decoder_layers(root):
            fully_shard(layer, **kwargs)
        fully_shard(root, **kwargs)
        self.world = world

    # ----- slots -----------------------------------------------------------------------------------
    def _layers(self) -> list[LoraLinear]:
        return [m for _, m in self.model.model.named_modules() if isinstance(m, LoraLinear)]

    def _rename(self, old: str, new: str) -> None:
        for module in self._layers():
            for table in (module.lora_A, module.lora_B, module.lora_dropout):
                table[new] = table.pop(old)
            module.scaling[new] = module.scaling.pop(old)

    def _add_adapter(self, name: str, config: LoraConfig, seed: int) -> None:
        self.model.slots.check_new(name, config)
        layers = self._layers()
        free = sorted(k for k in layers[0].lora_A if k.startswith(FREE))[0]
        self._rename(free, name)
        r = config.r
        # PEFT's draws for a rank-r adapter, layer by layer in module order: its two nn.Linear initialise
        # themselves (A, then B), then A is drawn again (kaiming uniform) and B zeroed.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            initial = []
            for module in layers:
                lora_a = torch.nn.Linear(module.in_features, r, bias=False)
                torch.nn.Linear(r, module.out_features, bias=False)
                torch.nn.init.kaiming_uniform_(lora_a.weight, a=math.sqrt(5))
                initial.append(lora_a.weight.detach())
        with torch.no_grad():
            for module, a in zip(layers, initial):
                self._set(module.lora_A[name].weight, torch.nn.functional.pad(a, (0, 0, 0, self.max_rank - r)))
                self._set(module.lora_B[name].weight, torch.zeros(module.out_features, self.max_rank))
                module.scaling[name] = config.lora_alpha / r
        self.model.slots.add(Tenant(name, config))

    def _remove_adapter(self, name: str) -> None:
        """The tenant's slot becomes free again (its weights are set afresh by the next tenant to take it)."""
        taken = {k for k in self._layers()[0].lora_A if k.startswith(FREE)}
        free = next(f"{FREE}{i}" for i in range(self.model.slots.max_loras) if f"{FREE}{i}" not in taken)
        for p in self.model.tenant_parameters(name):
            p.grad = None
        self._rename(name, free)
        self.model.slots.remove(name)

    @staticmethod
    def _set(param: torch.nn.Parameter, full: torch.Tensor) -> None:
        """Give a sharded parameter the value `full` (the same on every rank): each rank keeps its shard."""
        from torch.distributed.tensor import distribute_tensor

        param.copy_(distribute_tensor(full.to(param.dtype), param.device_mesh, param.placements))

    def _config(self, name: str) -> LoraConfig:
        return self.model.slots.get(name, "config").config

    # ----- states ----------------------------------------------------------------------------------
    def _peft_keys(self, name: str) -> list[tuple[str, torch.nn.Parameter]]:
        """(PEFT's file key, sharded parameter) of tenant `name`'s weights."""
        return [(key.replace(f".{name}.", "."), p) for key, p in self.model.model.named_parameters()
                if f".lora_A.{name}." in key or f".lora_B.{name}." in key]

    def _write_adapter(self, name: str, folder: Path) -> None:
        config = self._config(name)
        r = config.r
        tensors = {}
        for key, p in self._peft_keys(name):  # every rank gathers (collective); rank 0 writes
            full = p.detach().full_tensor().float().cpu()
            tensors[key] = (full[:r] if ".lora_A." in key else full[:, :r]).contiguous()
        if _rank_and_world()[0] == 0:
            target = folder / "adapter"
            target.mkdir()
            save_file(tensors, str(target / ADAPTER_WEIGHTS))
            modules = sorted({key.split(".lora_")[0].rsplit(".", 1)[-1] for key in tensors})
            LoraConfig(r=r, lora_alpha=config.lora_alpha, lora_dropout=0.0, target_modules=modules,
                       task_type="CAUSAL_LM").save_pretrained(str(target))
            self.model.tokenizer.save_pretrained(str(target))

    def _read_adapter(self, name: str, source: Path) -> None:
        weights = load_file(str(source / ADAPTER_WEIGHTS))
        keys = self._peft_keys(name)
        missing = [key for key, _ in keys if key not in weights]
        if missing:
            raise UserError(f"the saved state lacks {len(missing)} of this model's adapter weights (e.g. {missing[0]})")
        pad = self.max_rank - self._config(name).r
        with torch.no_grad():
            for key, p in keys:
                value = weights[key].float()
                value = torch.nn.functional.pad(value, (0, 0, 0, pad) if ".lora_A." in key else (0, pad))
                self._set(p, value)

    def _optimizer_layout(self) -> dict:
        return {"backend": "transformers", "fsdp": self.world}

    def _optimizer_file(self) -> tuple[str, bool]:
        rank, _ = _rank_and_world()
        return f"optimizer-shard{rank}.pt", True  # each rank its shards

    def _save_optimizer(self, name: str, path: Path) -> None:
        state = self.optimizers[name].state_dict()
        state["state"] = {i: {k: getattr(v, "to_local", lambda v=v: v)() for k, v in s.items()}
                          for i, s in state["state"].items()}
        torch.save(state, path)

    def _load_optimizer(self, name: str, path: Path) -> None:
        from torch.distributed.tensor import DTensor

        optimizer = self.optimizers[name]
        state = torch.load(path, weights_only=True)
        params = [p for group in optimizer.param_groups for p in group["params"]]
        for i, s in state["state"].items():
            p = params[int(i)]
            for k, v in s.items():
                if k != "step" and v.shape == p.to_local().shape:
                    s[k] = DTensor.from_local(v, p.device_mesh, p.placements)
        optimizer.load_state_dict(state)

    # ----- passes ----------------------------------------------------------------------------------
    def _sum_and_clip(self, params: list[torch.nn.Parameter], max_norm: float) -> float:
        # FSDP's reduce-scatter averaged the ranks' gradients; Tinker's losses are sums (a custom divide factor
        # would need PREMUL_SUM, which gloo lacks): times the world, exact for a power of two.
        grads = [p.grad for p in params if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, float(self.world))
        return norm_as_float(torch.nn.utils.clip_grad_norm_(params, max_norm))
