"""LoRA on megatron-core's column- and row-parallel linears, split the way their base weights are.

    column-parallel base (linear_qkv, linear_fc1):  W [out/tp, in]  ->  A [r, in] whole,  B [out/tp, r] split
    row-parallel base (linear_proj, linear_fc2):    W [out, in/tp]  ->  A [r, in/tp] split, B [out, r] whole

so the adapter's delta B·A has exactly the shards of W (merging is local to each rank). A linear may hold
several named adapters (`<linear>.lora_A.<name>`, `<linear>.lora_B.<name>`: the tenants of a multi-LoRA
model, or MegatronModel's one adapter) and a forward hook that adds `scale · B(A(x))` to the linear's
output; the base parameter names stay as they are, so the bridge and dist checkpoints see the same model.
The communication mirrors megatron's own linears: the low-rank activations are all-reduced where a whole
parameter meets split ones, so every whole parameter gets the full gradient on every rank (under
sequence parallelism the input is gathered and the output scattered along the sequence, like the base's).

Which rows go through which adapter is the `LoraRowRouter`'s to say: megatron's activations are
[sequence, batch, hidden], so a row is a slice of dim 1. A model with one adapter routes every row to it;
a multi-tenant model names a group of rows per adapter for each micro-batch (rows of one tenant are
contiguous), and each group is computed with its own adapter's matrices only.

A is initialised as PEFT does (Kaiming-uniform), from a generator seeded by the adapter's seed and the
layer's global name, on the whole matrix and then sliced, and B is zero: an adapter is the same whatever
the tp/pp layout. PEFT adapter files are written and read by `twinkle_core.convert.lora_peft`.
"""
from __future__ import annotations

import contextlib
import hashlib
import math
import re
import types
from typing import Iterator

import torch

LORA_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
_COLUMN = ("linear_qkv", "linear_fc1")


# Hugging Face projection names → the fused megatron linear that holds them (all of a group, or none)
HF_GROUPS = {"linear_qkv": ("q_proj", "k_proj", "v_proj"), "linear_proj": ("o_proj",),
             "linear_fc1": ("gate_proj", "up_proj"), "linear_fc2": ("down_proj",)}


class LoraRowRouter:
    """Says which rows of the running micro-batch each adapter takes (groups with `.adapter` and `.rows`)."""

    def __init__(self, default: str | None = None):
        self.default = default  # with no groups named, every row goes through this adapter
        self.groups: tuple | None = None

    @contextlib.contextmanager
    def route(self, groups) -> Iterator[None]:
        previous, self.groups = self.groups, tuple(groups)
        try:
            yield
        finally:
            self.groups = previous

    def current(self) -> list[tuple[str, slice]]:
        if self.groups is not None:
            return [(group.adapter, group.rows) for group in self.groups]
        if self.default is None:
            raise RuntimeError("a multi-tenant megatron model ran without naming the adapter of its rows: use "
                               "MultiLoraMegatronModel's verbs with adapter_name=.")
        return [(self.default, slice(None))]


def _resolve_targets(config) -> set[str]:
    targets = config.target_modules
    if targets is None or targets == "all-linear":
        return set(LORA_TARGETS)
    targets = {targets} if isinstance(targets, str) else set(targets)
    for fused, hf_names in HF_GROUPS.items():
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


def check_lora_config(config) -> set[str]:
    """The megatron linears `config` adapts; raises for what the Megatron backend's LoRA does not have."""
    unsupported = [name for name, value in (("use_dora", config.use_dora), ("bias", config.bias != "none"),
                                            ("modules_to_save", bool(config.modules_to_save)))
                   if value]
    if unsupported:
        raise ValueError(f"LoraConfig: {unsupported} are not supported on the Megatron backend; plain LoRA "
                         "(r, lora_alpha, lora_dropout, use_rslora, target_modules) is.")
    return _resolve_targets(config)


def _global_name(model, name: str) -> str:
    """The parameter-free module name with this stage's local layer index replaced by the global one."""
    match = re.match(r"^decoder\.layers\.(\d+)\.(.+)$", name)
    if not match:
        return name
    layer = model.decoder.layers[int(match.group(1))].layer_number - 1
    return f"decoder.layers.{layer}.{match.group(2)}"


def _seeded_generator(name: str) -> torch.Generator:
    return torch.Generator().manual_seed(int.from_bytes(hashlib.sha256(name.encode()).digest()[:6], "big"))


def add_megatron_lora(model, config, adapter_name: str = "default", router: LoraRowRouter | None = None,
                      seed: int = 0, dtype: torch.dtype | None = None):
    """Attach adapter `adapter_name` to the targeted (non-expert) linears of `model` and freeze the base.

    `dtype`: the adapter's storage dtype (default: its base weight's). Returns `config`.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    targets = check_lora_config(config)
    tp_rank, tp = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    for name, param in model.named_parameters():
        if ".lora_" not in name:
            param.requires_grad_(False)
    adapted = 0
    for name, module in list(model.named_modules()):
        leaf = name.rsplit(".", 1)[-1]
        if leaf not in targets or getattr(module, "is_expert", False) or ".experts." in name:
            continue
        if not isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            continue
        if not hasattr(module, "lora_A"):
            _make_adaptable(module, column=leaf in _COLUMN, router=router or LoraRowRouter(adapter_name))
        out_local, in_local = module.weight.shape
        in_full = in_local if module.lora_column else in_local * tp
        a_full = torch.empty(config.r, in_full)
        generator = _seeded_generator(f"{seed}:{_global_name(model, name)}")
        torch.nn.init.kaiming_uniform_(a_full, a=math.sqrt(5), generator=generator)
        a = a_full if module.lora_column else a_full.chunk(tp, dim=1)[tp_rank]
        dtype_, device = dtype or module.weight.dtype, module.weight.device
        module.lora_A[adapter_name] = torch.nn.Parameter(a.contiguous().to(device, dtype_))
        module.lora_B[adapter_name] = torch.nn.Parameter(torch.zeros(out_local, config.r, device=device,
                                                                     dtype=dtype_))
        split = module.lora_B[adapter_name] if module.lora_column else module.lora_A[adapter_name]
        set_tensor_model_parallel_attributes(split, is_parallel=True, dim=0 if module.lora_column else 1, stride=1)
        module.lora_scale[adapter_name] = config.lora_alpha / (math.sqrt(config.r) if config.use_rslora else config.r)
        module.lora_dropout[adapter_name] = (torch.nn.Dropout(config.lora_dropout) if config.lora_dropout
                                             else torch.nn.Identity())
        adapted += 1
    if adapted == 0 and ps.get_pipeline_model_parallel_world_size() == 1:
        raise ValueError(f"LoraConfig.target_modules={sorted(targets)} matched no linear of the model.")
    return config


def _make_adaptable(module, column: bool, router: LoraRowRouter) -> None:
    """Give a parallel linear its adapter containers, the forward hook and the checkpoint entries."""
    module.lora_A = torch.nn.ParameterDict()
    module.lora_B = torch.nn.ParameterDict()
    module.lora_dropout = torch.nn.ModuleDict()
    module.lora_scale = {}
    module.lora_column = column
    module.lora_router = router
    module.register_forward_hook(_lora_forward)
    module.sharded_state_dict = types.MethodType(_lora_sharded_state_dict(module.sharded_state_dict), module)


def remove_megatron_lora(model, adapter_name: str) -> None:
    """Take adapter `adapter_name` off every linear of `model` (its parameters are freed)."""
    for _, module in lora_modules(model, adapter_name):
        for container in (module.lora_A, module.lora_B, module.lora_dropout):
            del container[adapter_name]
        del module.lora_scale[adapter_name]


def _low_rank(module, name: str, x: torch.Tensor) -> torch.Tensor:
    """dropout(x) · Aᵀ, with the tp communication of the linear's parallel style."""
    from megatron.core.tensor_parallel import mappings

    a = module.lora_A[name]
    low = module.lora_dropout[name](x).to(a.dtype) @ a.t()
    if module.lora_column:
        return mappings.copy_to_tensor_model_parallel_region(low)
    return mappings.reduce_from_tensor_model_parallel_region(low)


def _lora_forward(module, args, output):
    """Add scale · B(A(x)) of each row group's adapter to the linear's (output, bias)."""
    from megatron.core.tensor_parallel import mappings

    out, bias = output
    if not module.lora_A:
        return output
    x = args[0]  # [sequence, batch, hidden]
    if module.lora_column and module.sequence_parallel:  # the base gathered the sequence: so does the adapter
        x = mappings.gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=False)
    groups = module.lora_router.current()
    if not any(name in module.lora_A for name, _ in groups):
        return output
    deltas = []
    for name, rows in groups:
        part = x if len(groups) == 1 else x[:, rows]
        if part.shape[1] == 0:
            continue
        if name in module.lora_A:
            low = _low_rank(module, name, part)
            deltas.append(module.lora_scale[name] * (low @ module.lora_B[name].t()).to(out.dtype))
        else:  # this adapter leaves this linear alone
            deltas.append(out.new_zeros((part.shape[0], part.shape[1], out.shape[2])))
    delta = deltas[0] if len(deltas) == 1 else torch.cat(deltas, dim=1)
    if not module.lora_column and module.sequence_parallel:  # the base reduce-scatters along the sequence
        delta = mappings.scatter_to_sequence_parallel_region(delta)
    return out + delta, bias


def _lora_sharded_state_dict(original):
    """The linear's dist-checkpoint entries, with each adapter sharded along the dimension it is split on."""

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        state = {k: v for k, v in original(prefix, sharded_offsets, metadata).items()
                 if not k.startswith((f"{prefix}lora_A.", f"{prefix}lora_B."))}
        tensors, axis = {}, {}
        for name in self.lora_A:
            tensors[f"lora_A.{name}"], tensors[f"lora_B.{name}"] = self.lora_A[name], self.lora_B[name]
            axis[f"lora_B.{name}" if self.lora_column else f"lora_A.{name}"] = 0 if self.lora_column else 1
        state.update(make_sharded_tensors_for_checkpoint(tensors, prefix, axis, sharded_offsets))
        return state

    return sharded_state_dict


def lora_modules(model, adapter_name: str | None = None) -> list:
    """(name, linear) of every linear holding an adapter (`adapter_name`: that one)."""
    return [(name, module) for name, module in model.named_modules()
            if hasattr(module, "lora_A") and (module.lora_A if adapter_name is None else adapter_name in module.lora_A)]


def adapter_parameters(model, adapter_name: str) -> list[torch.nn.Parameter]:
    """Adapter `adapter_name`'s parameters on this rank (its shards under tp)."""
    return [p for _, module in lora_modules(model, adapter_name)
            for p in (module.lora_A[adapter_name], module.lora_B[adapter_name])]


@torch.no_grad()
def merge_lora(model, adapter_name: str, sign: float = 1.0) -> None:
    """W += sign · scale · B·A on every rank's shard (sign -1 takes a merge out again)."""
    for _, module in lora_modules(model, adapter_name):
        delta = module.lora_B[adapter_name].float() @ module.lora_A[adapter_name].float()
        module.weight.add_((sign * module.lora_scale[adapter_name] * delta).to(module.weight.dtype))
