"""LoRA on megatron-core's column- and row-parallel linears, split the way their base weights are.

    column-parallel base (linear_qkv, linear_fc1):  W [out/tp, in]  ->  A [r, in] whole,  B [out/tp, r] split
    row-parallel base (linear_proj, linear_fc2):    W [out, in/tp]  ->  A [r, in/tp] split, B [out, r] whole

so the adapter's delta B·A has exactly the shards of W (merging is local to each rank). The adapter is
attached to the existing linear as two parameters (`<linear>.lora_A`, `<linear>.lora_B`) and a forward
hook that adds `scale · B(A(x))` to the linear's output; the base parameter names stay as they are, so
the bridge and dist checkpoints see the same model. The communication mirrors megatron's own linears:
the low-rank activations are all-reduced where a whole parameter meets split ones, so every whole
parameter gets the full gradient on every rank (under sequence parallelism the input is gathered and the
output scattered along the sequence, like the base's).

A is initialised as PEFT does (Kaiming-uniform), from a generator seeded by the layer's global name, on
the whole matrix and then sliced, and B is zero: the adapter is the same whatever the tp/pp layout.
Export turns it into a standard PEFT adapter of the HF model (q/k/v and gate/up share their A; their B
rows are split as the bridge splits the fused weights).
"""
from __future__ import annotations

import hashlib
import math
import re
import types
from pathlib import Path

import torch
import torch.distributed as dist

LORA_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
_COLUMN = ("linear_qkv", "linear_fc1")


# Hugging Face projection names → the fused megatron linear that holds them (all of a group, or none)
_HF_GROUPS = {"linear_qkv": ("q_proj", "k_proj", "v_proj"), "linear_proj": ("o_proj",),
              "linear_fc1": ("gate_proj", "up_proj"), "linear_fc2": ("down_proj",)}


def _resolve_targets(config) -> set[str]:
    targets = config.target_modules
    if targets is None or targets == "all-linear":
        return set(LORA_TARGETS)
    targets = {targets} if isinstance(targets, str) else set(targets)
    for fused, hf_names in _HF_GROUPS.items():
        given = targets & set(hf_names)
        if given and given != set(hf_names):
            raise ValueError(f"LoraConfig.target_modules={sorted(targets)}: megatron fuses {list(hf_names)} into "
                             f"{fused}, so they are adapted together; list all of them, {fused!r}, or none.")
        if given:
            targets = (targets - given) | {fused}
    unknown = sorted(targets - set(LORA_TARGETS))
    if unknown:
        raise ValueError(f"LoraConfig.target_modules: {unknown} are not megatron linears; the Megatron backend "
                         f"adapts {list(LORA_TARGETS)} (or 'all-linear' for all of them).")
    return targets


def _check_config(config) -> None:
    unsupported = [name for name, value in (("use_dora", config.use_dora), ("bias", config.bias != "none"),
                                            ("modules_to_save", bool(config.modules_to_save)))
                   if value]
    if unsupported:
        raise ValueError(f"LoraConfig: {unsupported} are not supported on the Megatron backend; plain LoRA "
                         "(r, lora_alpha, lora_dropout, use_rslora, target_modules) is.")


def _global_name(model, name: str) -> str:
    """The parameter-free module name with this stage's local layer index replaced by the global one."""
    match = re.match(r"^decoder\.layers\.(\d+)\.(.+)$", name)
    if not match:
        return name
    layer = model.decoder.layers[int(match.group(1))].layer_number - 1
    return f"decoder.layers.{layer}.{match.group(2)}"


def _seeded_generator(name: str) -> torch.Generator:
    return torch.Generator().manual_seed(int.from_bytes(hashlib.sha256(name.encode()).digest()[:6], "big"))


def add_megatron_lora(model, config):
    """Attach LoRA to the targeted (non-expert) linears of `model`, freeze everything else; returns `config`."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    _check_config(config)
    targets = _resolve_targets(config)
    tp_rank, tp = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    for param in model.parameters():
        param.requires_grad_(False)
    adapted = 0
    for name, module in list(model.named_modules()):
        leaf = name.rsplit(".", 1)[-1]
        if leaf not in targets or getattr(module, "is_expert", False) or ".experts." in name:
            continue
        if not isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            continue
        column = leaf in _COLUMN
        out_local, in_local = module.weight.shape
        in_full = in_local if column else in_local * tp
        a_full = torch.empty(config.r, in_full)
        torch.nn.init.kaiming_uniform_(a_full, a=math.sqrt(5), generator=_seeded_generator(_global_name(model, name)))
        a = a_full if column else a_full.chunk(tp, dim=1)[tp_rank]
        dtype, device = module.weight.dtype, module.weight.device
        module.lora_A = torch.nn.Parameter(a.contiguous().to(device, dtype))
        module.lora_B = torch.nn.Parameter(torch.zeros(out_local, config.r, device=device, dtype=dtype))
        split = module.lora_B if column else module.lora_A
        set_tensor_model_parallel_attributes(split, is_parallel=True, dim=0 if column else 1, stride=1)
        module.lora_scale = config.lora_alpha / (math.sqrt(config.r) if config.use_rslora else config.r)
        module.lora_dropout = torch.nn.Dropout(config.lora_dropout) if config.lora_dropout else torch.nn.Identity()
        module.lora_column = column
        module.register_forward_hook(_lora_forward)
        module.sharded_state_dict = types.MethodType(_lora_sharded_state_dict(module.sharded_state_dict), module)
        adapted += 1
    if adapted == 0 and ps.get_pipeline_model_parallel_world_size() == 1:
        raise ValueError(f"LoraConfig.target_modules={sorted(targets)} matched no linear of the model.")
    return config


def _lora_forward(module, args, output):
    """Add scale · B(A(x)) to the linear's (output, bias), with the communication of its parallel style."""
    from megatron.core.tensor_parallel import mappings

    x = module.lora_dropout(args[0])
    sequence_parallel = module.sequence_parallel
    out, bias = output
    if module.lora_column:
        if sequence_parallel:  # the base gathers the sequence; each rank then needs the whole low-rank input
            x = mappings.gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=False)
        low = mappings.copy_to_tensor_model_parallel_region(x @ module.lora_A.t())
        delta = low @ module.lora_B.t()
    else:
        low = mappings.reduce_from_tensor_model_parallel_region(x @ module.lora_A.t())
        delta = low @ module.lora_B.t()
        if sequence_parallel:  # the base reduce-scatters its output along the sequence
            delta = mappings.scatter_to_sequence_parallel_region(delta)
    return out + module.lora_scale * delta.to(out.dtype), bias


def _lora_sharded_state_dict(original):
    """The linear's dist-checkpoint entries, with its adapter sharded along the dimension it is split on."""

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        state = original(prefix, sharded_offsets, metadata)
        for key in ("lora_A", "lora_B"):
            state.pop(f"{prefix}{key}", None)
        axis = {"lora_B": 0} if self.lora_column else {"lora_A": 1}
        state.update(make_sharded_tensors_for_checkpoint(
            {"lora_A": self.lora_A, "lora_B": self.lora_B}, prefix, axis, sharded_offsets))
        return state

    return sharded_state_dict


def lora_modules(model):
    return [(name, module) for name, module in model.named_modules() if hasattr(module, "lora_A")]


@torch.no_grad()
def merge_lora(model, sign: float = 1.0) -> None:
    """W += sign · scale · B·A on every rank's shard (sign -1 takes a merge out again)."""
    for _, module in lora_modules(model):
        delta = module.lora_B.float() @ module.lora_A.float()
        module.weight.add_((sign * module.lora_scale * delta).to(module.weight.dtype))


def export_peft_adapter(model, hf_config, lora_config, output_dir: str | Path) -> Path:
    """Write the adapter of `model` (or of its chunks) as a PEFT adapter directory of the HF model (all ranks
    call this; rank 0 writes)."""
    from megatron.core import parallel_state as ps
    from peft import LoraConfig
    from safetensors.torch import save_file

    from twinkle_core.convert.bridge import _find_rule, shapes_for
    from twinkle_core.convert.mapping import mapping_for
    from twinkle_core.convert.transforms import export_tensors

    table, shapes = mapping_for(hf_config), shapes_for(hf_config)
    tp, group = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_group()
    tensors: dict[str, torch.Tensor] = {}
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    for chunk, name, module in ((chunk, name, module) for chunk in chunks for name, module in lora_modules(chunk)):
        rule, hf_names = _find_rule(chunk, table, f"{name}.weight")
        split = module.lora_B if module.lora_column else module.lora_A
        shards = [split.detach().float()]
        if tp > 1:
            shards = [torch.empty_like(shards[0]) for _ in range(tp)]
            dist.all_gather(shards, split.detach().float().contiguous(), group=group)
        if module.lora_column:  # q/k/v (gate/up) share A; their B rows split as the fused weight's rows
            parts = export_tensors(rule, hf_names, shards, shapes)
            pairs = {hf: (module.lora_A.detach().float().clone(), b) for hf, b in parts.items()}
        else:
            pairs = {hf_names[0]: (torch.cat(shards, dim=1), module.lora_B.detach().float())}
        for hf_name, (a, b) in pairs.items():
            stem = "base_model.model." + hf_name.removesuffix(".weight")
            tensors[f"{stem}.lora_A.weight"] = a.cpu().contiguous()
            tensors[f"{stem}.lora_B.weight"] = b.cpu().contiguous()
    is_writer = ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0
    pooled = [tensors if is_writer else {}]
    if dist.is_initialized() and dist.get_world_size() > 1:
        pooled = [None] * dist.get_world_size()
        dist.all_gather_object(pooled, tensors if is_writer else {})
    output_dir = Path(output_dir)
    if not dist.is_initialized() or dist.get_rank() == 0:
        merged = {k: v for part in pooled for k, v in part.items()}
        output_dir.mkdir(parents=True, exist_ok=True)
        save_file(merged, str(output_dir / "adapter_model.safetensors"))
        hf_targets = sorted({key.split(".lora_")[0].rsplit(".", 1)[-1] for key in merged})
        LoraConfig(r=lora_config.r, lora_alpha=lora_config.lora_alpha, lora_dropout=lora_config.lora_dropout,
                   use_rslora=lora_config.use_rslora, target_modules=hf_targets,
                   task_type="CAUSAL_LM").save_pretrained(str(output_dir))
    if dist.is_initialized():
        dist.barrier()
    return output_dir
