"""The generic transforms of the bridge, each in both directions, aware of tensor-parallel shards.

Loading (HF → megatron) fills one tp rank's shard straight from row (or column) slices of the HF tensors,
reading rows directly into the parameter's memory, so a rank reads only what it holds and copies nothing
twice. Exporting (megatron → HF) takes the tp ranks' shards, in rank order, and rebuilds the HF tensors.
`expected_hf_shapes` says which full HF shapes a megatron shard implies: loading checks a checkpoint
against it before reading (a mismatch names the tensor), and exporting plans its shards with it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from twinkle_core.convert.mapping import COLUMN, Rule


class Reader(Protocol):
    """What loading needs of a checkpoint (see `safetensors_io.SafetensorsReader`)."""

    def read_rows_into(self, name: str, out: torch.Tensor, start: int = 0) -> None: ...

    def read(self, name: str, dim: int | None = None, start: int = 0, stop: int = 0) -> torch.Tensor: ...


@dataclass(frozen=True)
class Shapes:
    """The model sizes the transforms need."""

    heads: int
    groups: int  # key/value heads (query groups)
    head_dim: int
    vocab: int  # the HF vocabulary (megatron's is padded; the padding rows are dropped on export)

    @property
    def q_per_group(self) -> int:
        return self.heads // self.groups


def expected_hf_shapes(rule: Rule, names: tuple[str, ...], local: torch.Size, shapes: Shapes,
                       tp: int) -> dict[str, tuple[int, ...]]:
    """The full HF shape each source tensor must have for a megatron shard of shape `local`."""
    rest = tuple(local[1:])
    if rule.transform == "qkv":
        q, k, v = names
        return {q: (shapes.heads * shapes.head_dim, *rest), k: (shapes.groups * shapes.head_dim, *rest),
                v: (shapes.groups * shapes.head_dim, *rest)}
    if rule.transform == "gate_up":
        return {name: (local[0] * tp // 2, *rest) for name in names}
    if rule.transform == "vocab":
        return {names[0]: (shapes.vocab, *rest)}
    full = list(local)
    if rule.tp_dim is not None:
        full[rule.tp_dim] *= tp
    return {names[0]: tuple(full)}


def _even(total: int, rank: int, size: int) -> tuple[int, int]:
    part = total // size
    return rank * part, (rank + 1) * part


def load_shard(rule: Rule, names: tuple[str, ...], reader: Reader, out: torch.Tensor, shapes: Shapes,
               tp_rank: int, tp: int) -> None:
    """Fill `out`, this tp rank's shard of the megatron parameter `rule` makes out of the HF tensors `names`.

    Rows are read straight into `out` (or its row blocks); only column splits go through a whole tensor.
    """
    if rule.transform == "qkv":
        _load_qkv(names, reader, out, shapes, tp_rank, tp)
    elif rule.transform == "gate_up":
        half = out.shape[0] // 2
        for part, name in enumerate(names):
            reader.read_rows_into(name, out[part * half:(part + 1) * half], tp_rank * half)
    elif rule.transform == "vocab":
        start = tp_rank * out.shape[0]
        held = max(0, min(out.shape[0], shapes.vocab - start))
        reader.read_rows_into(names[0], out[:held], start)
        out[held:].zero_()  # megatron's padding rows
    elif rule.tp_dim == COLUMN and tp > 1:
        reader.read_rows_into(names[0], out, tp_rank * out.shape[0])
    elif rule.tp_dim is None or tp == 1:
        reader.read_rows_into(names[0], out.view(-1, *out.shape[1:]) if out.dim() else out.view(1))
    else:
        start, stop = _even(out.shape[rule.tp_dim] * tp, tp_rank, tp)
        out.copy_(reader.read(names[0], rule.tp_dim, start, stop))


def _load_qkv(names, reader: Reader, out: torch.Tensor, shapes: Shapes, tp_rank: int, tp: int) -> None:
    """Per query group g of this rank: its q heads, then its k head, then its v head, as row blocks."""
    per_rank, hd = shapes.groups // tp, shapes.head_dim
    q_rows = shapes.q_per_group * hd
    blocks = out.view(per_rank, q_rows + 2 * hd, *out.shape[1:])
    for local in range(per_rank):
        group = tp_rank * per_rank + local
        reader.read_rows_into(names[0], blocks[local, :q_rows], group * q_rows)
        reader.read_rows_into(names[1], blocks[local, q_rows:q_rows + hd], group * hd)
        reader.read_rows_into(names[2], blocks[local, q_rows + hd:], group * hd)


def export_tensors(rule: Rule, names: tuple[str, ...], shards: list[torch.Tensor],
                   shapes: Shapes) -> dict[str, torch.Tensor]:
    """The HF tensors `names` rebuilt from the tp ranks' shards (in rank order) of one megatron parameter."""
    if rule.transform == "qkv":
        full = torch.cat(shards)
        rest = full.shape[1:]
        q_rows = shapes.q_per_group * shapes.head_dim
        grouped = full.reshape(shapes.groups, q_rows + 2 * shapes.head_dim, *rest)
        q, k, v = grouped.split([q_rows, shapes.head_dim, shapes.head_dim], dim=1)
        return {name: part.reshape(-1, *rest) for name, part in zip(names, (q, k, v))}
    if rule.transform == "gate_up":
        halves = [shard.chunk(2) for shard in shards]
        return {names[0]: torch.cat([h[0] for h in halves]), names[1]: torch.cat([h[1] for h in halves])}
    if rule.transform == "vocab":
        return {names[0]: torch.cat(shards)[: shapes.vocab]}
    if rule.tp_dim is None:
        return {names[0]: shards[0]}
    return {names[0]: torch.cat(shards, dim=rule.tp_dim)}

