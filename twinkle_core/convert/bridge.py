"""HF safetensors ↔ a (possibly tp/pp-split) megatron-core GPTModel, through the family's mapping table.

Loading: every rank walks its own parameters (a pipeline stage holds a contiguous block of layers; the
global layer index is `layer.layer_number - 1`), finds each one's rule, checks the HF shapes the rule
implies, and fills the parameter from slices of the HF tensors (see `transforms.load_shard`). Nothing
outside the rank's shard is read. Afterwards the ranks pool the names they used: an HF tensor that no
rank used (a bias the config does not expect, say) is an error, as is a missing one.

Exporting: the tp ranks of a stage gather each parameter's shards (one parameter at a time, so memory
stays at one full tensor), tp rank 0 of each stage (data-parallel rank 0; for experts, of each expert
block) turns it back into HF tensors and writes each into its planned place in size-capped shards; global
rank 0 then names the shards and writes the index. Config, generation config and tokenizer are copied by
the caller (`megatron_checkpoint.copy_hf_side_files`).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from twinkle_core.convert.mapping import MappingTable, Rule, mapping_for, table_names
from twinkle_core.convert.safetensors_io import SafetensorsReader, ShardWriter, finish_shards
from twinkle_core.convert.transforms import Shapes, expected_hf_shapes, export_tensors, load_shard
from twinkle_core.errors import UserError
from twinkle_core.megatron.model_builder import head_dim

_LAYER_PARAM = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


class CheckpointMismatchError(UserError):
    """An HF checkpoint that does not fit the megatron model: missing, extra or misshapen tensors."""


@dataclass(frozen=True)
class MappedParameter:
    name: str  # megatron name on this rank
    param: torch.Tensor
    rule: Rule
    hf_names: tuple[str, ...]


def _tp(rule: Rule) -> tuple[int, int]:
    """This rank's place in the tensor-parallel group that splits `rule`'s parameter: (rank, size)."""
    from megatron.core import parallel_state as ps

    if rule.is_expert:  # routed experts are split by expert-tensor parallelism (equal to tp by default)
        return ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size()
    return ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()


def _tp_group(rule: Rule):
    from megatron.core import parallel_state as ps

    return ps.get_expert_tensor_parallel_group() if rule.is_expert else ps.get_tensor_model_parallel_group()


def _global_expert(model, local_expert: int) -> int:
    """Expert parallelism gives each rank a contiguous block of the experts."""
    from megatron.core import parallel_state as ps

    per_rank = model.config.num_moe_experts // ps.get_expert_model_parallel_world_size()
    return ps.get_expert_model_parallel_rank() * per_rank + local_expert


def shapes_for(hf_config) -> Shapes:
    return Shapes(heads=hf_config.num_attention_heads, groups=hf_config.num_key_value_heads,
                  head_dim=head_dim(hf_config), vocab=hf_config.vocab_size)


def find_rule(model, table: MappingTable, name: str) -> tuple[Rule, tuple[str, ...]] | None:
    match = _LAYER_PARAM.match(name)
    if not match:
        rule = table.model_rule(name)
        return (rule, rule.hf_names()) if rule else None
    found = table.layer_rule(match.group(2))
    if found is None:
        return None
    rule, expert = found
    layer = model.decoder.layers[int(match.group(1))].layer_number - 1
    return rule, rule.hf_names(layer, None if expert is None else _global_expert(model, expert))


def mapped_parameters(model, table: MappingTable) -> list[MappedParameter]:
    """This rank's parameters (and mapped buffers, e.g. the router's expert bias) with their rules.

    A parameter no rule covers is an error; buffers without a rule are run-time state and are skipped.
    """
    mapped = []
    named = [*model.named_parameters(), *model.named_buffers()]
    local = table_names(model, [name for name, _ in named])  # a Transformer-Engine model's fused-norm names
    for name, tensor in named:
        if ".lora_" in name:  # LoRA adapters (twinkle_core.megatron.lora) are exported as PEFT adapters
            continue
        found = find_rule(model, table, local[name])
        is_parameter = isinstance(tensor, torch.nn.Parameter)
        if found is None and is_parameter:
            raise CheckpointMismatchError(f"megatron parameter {name!r} has no HF mapping; the table covers "
                                          f"{[r.megatron for r in table.model + table.layer]}.")
        if found is not None:
            mapped.append(MappedParameter(name, tensor, *found))
    return mapped


def _check_shapes(item: MappedParameter, reader: SafetensorsReader, shapes: Shapes, tp: int) -> None:
    """Every source tensor exists and has the full shape this shard implies (else: name both, and shapes)."""
    expected = expected_hf_shapes(item.rule, item.hf_names, item.param.shape, shapes, tp)
    for hf_name, shape in expected.items():
        if hf_name not in reader.files:
            raise CheckpointMismatchError(
                f"the HF checkpoint {reader.directory} has no tensor {hf_name!r}, needed for megatron parameter "
                f"{item.name!r}: the checkpoint is not of the architecture its config describes.")
        found = reader.shape(hf_name)
        if found != shape:
            raise CheckpointMismatchError(
                f"HF tensor {hf_name!r} has shape {list(found)} but megatron parameter {item.name!r} (shard "
                f"{list(item.param.shape)} at tp={tp}) needs {list(shape)}: the config does not match the weights.")


def _chunks(model) -> list:
    """A model, or the model chunks of virtual pipeline stages, as a list."""
    return list(model) if isinstance(model, (list, tuple)) else [model]


def load_hf_weights(model, hf_config, hf_dir: str | Path) -> None:
    """Fill this rank's part of `model` (or of each of its chunks) from the HF checkpoint in `hf_dir`,
    reading only its slices."""
    table = mapping_for(hf_config)
    shapes = shapes_for(hf_config)
    reader = SafetensorsReader(hf_dir)
    used: set[str] = set()
    try:
        with torch.no_grad():
            for item in (item for chunk in _chunks(model) for item in mapped_parameters(chunk, table)):
                tp_rank, tp = _tp(item.rule)
                _check_shapes(item, reader, shapes, tp)
                load_shard(item.rule, item.hf_names, reader, item.param.data, shapes, tp_rank, tp)
                used.update(item.hf_names)
    finally:
        reader.close()
    _check_all_used(reader.names() - _prediction_layer_tensors(reader.names(), hf_config), used, hf_dir)


def _prediction_layer_tensors(names: set[str], hf_config) -> set[str]:
    """DeepSeek-V3's multi-token-prediction layers (after the last decoder layer): not converted, as HF skips them."""
    if not getattr(hf_config, "num_nextn_predict_layers", 0):
        return set()
    first = hf_config.num_hidden_layers
    return {n for n in names if (m := re.match(r"model\.layers\.(\d+)\.", n)) and int(m.group(1)) >= first}


def _name_pattern(hf_name: str) -> str:
    return re.escape(hf_name).replace(r"\{i\}", r"\d+").replace(r"\{e\}", r"\d+")


def check_tensor_names(hf_dir: str | Path, hf_config) -> None:
    """Before any model is built: every tensor of the checkpoint has a rule in the table (names only).

    A model_type outside the table passes the config check when its keys are Llama's; this catches what
    the config cannot show (a norm after the MLP, fused q/k/v, a per-projection q norm).
    """
    table = mapping_for(hf_config)
    pattern = re.compile("|".join(_name_pattern(name) for rule in table.model + table.layer for name in rule.hf))
    names = SafetensorsReader(hf_dir).names()
    unmapped = sorted(n for n in names - _prediction_layer_tensors(names, hf_config) if not pattern.fullmatch(n))
    if unmapped:
        raise CheckpointMismatchError(
            f"{hf_config.model_type}: the HF checkpoint {hf_dir} has tensors the megatron-core mapping has no place "
            f"for: {unmapped[:6]}{' ...' if len(unmapped) > 6 else ''}; train it with backend='transformers'.")


def _check_all_used(available: set[str], used: set[str], hf_dir) -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        pooled: list[set[str] | None] = [None] * dist.get_world_size()
        dist.all_gather_object(pooled, used)
        used = set().union(*pooled)
    unused = sorted(available - used)
    if unused:
        raise CheckpointMismatchError(
            f"the HF checkpoint {hf_dir} has tensors the megatron model has no place for: {unused[:8]}"
            f"{' ...' if len(unused) > 8 else ''}; its config does not describe these weights (wrong family?).")


def _gather_tp(tensor: torch.Tensor, rule: Rule) -> list[torch.Tensor]:
    _, tp = _tp(rule)
    if tp == 1 or rule.tp_dim is None:
        return [tensor]
    shards = [torch.empty_like(tensor) for _ in range(tp)]
    dist.all_gather(shards, tensor.contiguous(), group=_tp_group(rule))
    return shards


def _is_writer(rule: Rule) -> bool:
    """One rank writes each tensor: tp rank 0 among the replicas of the stage (or of the expert's block)."""
    from megatron.core import parallel_state as ps

    if rule.is_expert:
        return ps.get_expert_tensor_parallel_rank() == 0 and ps.get_expert_data_parallel_rank() == 0
    return ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0


def export_hf_weights(model, hf_config, out_dir: str | Path, dtype: torch.dtype | None = None,
                      max_shard_bytes: int = 2 * 1024**3) -> list[str]:
    """Write `model` (or its chunks; all ranks call this) as HF safetensors shards + index in `out_dir`; the
    shard names.

    Parameters are written in `dtype`, by default the model's parameter dtype (megatron keeps norm weights
    in fp32 whatever that is; they were loaded from, and go back to, the checkpoint's dtype). Buffers (the
    router's expert bias) keep their own dtype: megatron and HF both hold them in fp32.
    """
    out_dir = Path(out_dir)
    dtype = dtype or _chunks(model)[0].config.params_dtype
    shapes = shapes_for(hf_config)
    table = mapping_for(hf_config)
    items = [item for chunk in _chunks(model) for item in mapped_parameters(chunk, table) if item.rule.exported]
    dtypes = {item.name: dtype if isinstance(item.param, torch.nn.Parameter) else item.param.dtype for item in items}
    plan = [(name, shape, dtypes[item.name]) for item in items if _is_writer(item.rule)
            for name, shape in expected_hf_shapes(item.rule, item.hf_names, item.param.shape, shapes,
                                                  _tp(item.rule)[1]).items()]
    # Each writing rank's shards get their own prefix; rank 0 renames them all once every rank is done.
    writer = ShardWriter(out_dir, plan, prefix=f"rank{dist.get_rank() if dist.is_initialized() else 0:05d}",
                         max_shard_bytes=max_shard_bytes)
    try:
        with torch.no_grad():
            for item in items:
                shards = _gather_tp(item.param.detach(), item.rule)
                if _is_writer(item.rule):
                    for name, tensor in export_tensors(item.rule, item.hf_names, shards, shapes).items():
                        writer.write(name, tensor.to(dtypes[item.name]))
    finally:
        writer.close()
    return _index_on_rank0(out_dir, writer)


def _index_on_rank0(out_dir: Path, writer: ShardWriter) -> list[str]:
    weight_map, total = writer.weight_map, writer.total_bytes
    if dist.is_initialized() and dist.get_world_size() > 1:
        pooled: list[tuple | None] = [None] * dist.get_world_size()
        dist.all_gather_object(pooled, (weight_map, total))
        weight_map = {k: v for part, _ in pooled for k, v in part.items()}
        total = sum(size for _, size in pooled)
    files = finish_shards(out_dir, weight_map, total) if _is_rank0() else []
    if dist.is_initialized():
        dist.barrier()
    return files


def _is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0
