"""Megatron LoRA adapters as standard PEFT adapter directories of the Hugging Face model, both ways.

Export gathers each adapter's tp shards and writes `adapter_model.safetensors` + `adapter_config.json`,
which `PeftModel.from_pretrained(hf_model, dir)` loads: q/k/v (gate/up) share the fused linear's A, and
their B rows are split as the bridge splits the fused weight. Import reads such a directory into one
rank's shards with the bridge's own loading transforms; because megatron fuses q/k/v (gate/up) into one
linear with one A, an adapter whose fused projections have different A matrices (PEFT trains one per
projection) cannot be expressed and is refused with the reason.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from twinkle_core.convert.bridge import find_rule, shapes_for
from twinkle_core.convert.mapping import mapping_for
from twinkle_core.convert.transforms import export_tensors, load_shard
from twinkle_core.megatron.lora import HF_GROUPS, add_megatron_lora, lora_modules

ADAPTER_WEIGHTS = "adapter_model.safetensors"
_PREFIX = "base_model.model."


def _keys(hf_name: str) -> tuple[str, str]:
    stem = _PREFIX + hf_name.removesuffix(".weight")
    return f"{stem}.lora_A.weight", f"{stem}.lora_B.weight"


def _chunks(model) -> list:
    return list(model) if isinstance(model, (list, tuple)) else [model]


def export_peft_adapter(model, hf_config, lora_config, output_dir: str | Path, adapter_name: str = "default") -> Path:
    """Write adapter `adapter_name` of `model` (or of its chunks) as a PEFT adapter directory of the HF model
    (all ranks call this; rank 0 writes)."""
    from megatron.core import parallel_state as ps
    from peft import LoraConfig
    from safetensors.torch import save_file

    table, shapes = mapping_for(hf_config), shapes_for(hf_config)
    tp, group = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_group()
    tensors: dict[str, torch.Tensor] = {}
    for chunk in _chunks(model):
        for name, module in lora_modules(chunk, adapter_name):
            rule, hf_names = find_rule(chunk, table, f"{name}.weight")
            a, b = module.lora_A[adapter_name].detach().float(), module.lora_B[adapter_name].detach().float()
            split = b if module.lora_column else a
            shards = [split]
            if tp > 1:
                shards = [torch.empty_like(split) for _ in range(tp)]
                dist.all_gather(shards, split.contiguous(), group=group)
            if module.lora_column:  # q/k/v (gate/up) share A; their B rows split as the fused weight's rows
                pairs = {hf: (a.clone(), part) for hf, part in export_tensors(rule, hf_names, shards, shapes).items()}
            else:
                pairs = {hf_names[0]: (torch.cat(shards, dim=1), b)}
            for hf_name, (lora_a, lora_b) in pairs.items():
                key_a, key_b = _keys(hf_name)
                tensors[key_a], tensors[key_b] = lora_a.cpu().contiguous(), lora_b.cpu().contiguous()
    is_writer = ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0
    pooled = [tensors if is_writer else {}]
    if dist.is_initialized() and dist.get_world_size() > 1:
        pooled = [None] * dist.get_world_size()
        dist.all_gather_object(pooled, tensors if is_writer else {})
    output_dir = Path(output_dir)
    if not dist.is_initialized() or dist.get_rank() == 0:
        merged = {k: v for part in pooled for k, v in part.items()}
        output_dir.mkdir(parents=True, exist_ok=True)
        save_file(merged, str(output_dir / ADAPTER_WEIGHTS))
        hf_targets = sorted({key.split(".lora_")[0].rsplit(".", 1)[-1] for key in merged})
        LoraConfig(r=lora_config.r, lora_alpha=lora_config.lora_alpha, lora_dropout=lora_config.lora_dropout,
                   use_rslora=lora_config.use_rslora, target_modules=hf_targets,
                   task_type="CAUSAL_LM").save_pretrained(str(output_dir))
    if dist.is_initialized():
        dist.barrier()
    return output_dir


class _TensorReader:
    """The bridge's Reader over an in-memory dict of HF-named tensors."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors

    def read_rows_into(self, name: str, out: torch.Tensor, start: int = 0) -> None:
        out.copy_(self.tensors[name][start:start + out.shape[0]])

    def read(self, name: str, dim: int | None = None, start: int = 0, stop: int = 0) -> torch.Tensor:
        tensor = self.tensors[name]
        return tensor if dim is None else tensor.narrow(dim, start, stop - start)


def read_peft_config(adapter_dir: str | Path):
    """The LoraConfig of a PEFT adapter directory, with its HF target names as the megatron backend takes them."""
    from peft import LoraConfig

    adapter_dir = Path(adapter_dir)
    if not (adapter_dir / ADAPTER_WEIGHTS).is_file():
        raise FileNotFoundError(f"{adapter_dir} is not a PEFT adapter directory (no {ADAPTER_WEIGHTS}).")
    config = LoraConfig.from_pretrained(str(adapter_dir))
    config.target_modules = sorted(config.target_modules) if not isinstance(config.target_modules, str) \
        else config.target_modules
    return config


@torch.no_grad()
def load_peft_adapter(model, hf_config, adapter_dir: str | Path, adapter_name: str, router=None,
                      dtype: torch.dtype | None = None):
    """Add the PEFT adapter in `adapter_dir` to `model` (or its chunks) as `adapter_name`; returns its LoraConfig."""
    from megatron.core import parallel_state as ps
    from safetensors.torch import load_file

    config = read_peft_config(adapter_dir)
    tensors = {k: v.float() for k, v in load_file(str(Path(adapter_dir) / ADAPTER_WEIGHTS)).items()}
    _check_fusable(tensors)
    reader = _TensorReader({**{k.removesuffix(".lora_A.weight") + ".A": v for k, v in tensors.items()
                               if k.endswith(".lora_A.weight")},
                            **{k.removesuffix(".lora_B.weight") + ".B": v for k, v in tensors.items()
                               if k.endswith(".lora_B.weight")}})
    table, shapes = mapping_for(hf_config), shapes_for(hf_config)
    tp_rank, tp = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    for chunk in _chunks(model):
        add_megatron_lora(chunk, config, adapter_name, router=router, dtype=dtype)
        for name, module in lora_modules(chunk, adapter_name):
            rule, hf_names = find_rule(chunk, table, f"{name}.weight")
            stems = [_PREFIX + hf.removesuffix(".weight") for hf in hf_names]
            a, b = module.lora_A[adapter_name], module.lora_B[adapter_name]
            missing = [s for s in stems if s + ".A" not in reader.tensors]
            if missing:
                raise ValueError(f"{adapter_dir}: no LoRA weights for {missing[0]}, which its adapter_config's "
                                 f"target_modules={config.target_modules} adapt.")
            if module.lora_column:  # A whole (shared by the fused projections), B split like the fused weight
                a.copy_(reader.tensors[stems[0] + ".A"])
                load_shard(rule, tuple(s + ".B" for s in stems), reader, b.data, shapes, tp_rank, tp)
            else:  # A split along its input like the row-parallel weight, B whole
                load_shard(rule, (stems[0] + ".A",), reader, a.data, shapes, tp_rank, tp)
                b.copy_(reader.tensors[stems[0] + ".B"])
    return config


def _check_fusable(tensors: dict[str, torch.Tensor]) -> None:
    """Projections megatron fuses (q/k/v, gate/up) must share one A, as adapters exported from megatron do."""
    for fused, hf_names in HF_GROUPS.items():
        if len(hf_names) == 1:
            continue
        for key, a in tensors.items():
            if not key.endswith(f".{hf_names[0]}.lora_A.weight"):
                continue
            for other in hf_names[1:]:
                peer = tensors.get(key.replace(f".{hf_names[0]}.", f".{other}."))
                if peer is not None and not torch.equal(peer, a):
                    raise ValueError(
                        f"{key.removesuffix('.lora_A.weight')}: the adapter has different lora_A matrices for "
                        f"{list(hf_names)}, but megatron fuses them into {fused} with one A; load it on the "
                        "Transformers backend, or train it on the Megatron backend, which writes a shared A.")
