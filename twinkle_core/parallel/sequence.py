"""Sequence parallelism (`sp_size > 1`) for the Transformers backend: Ulysses attention over the sp group.

Each sp rank holds the same rows (the loader deals rows out by dp × fsdp rank only) and takes a contiguous
1/sp slice of every sequence, so activations, logits and the loss of a long sequence are split over sp ranks:

- `shard_batch` pads the batch to a multiple of sp (pad id, label -100), shifts the labels over the WHOLE
  sequence first (`shift_labels`, the Transformers convention; no target is lost at a slice edge), then
  slices input_ids, shift_labels and the global `position_ids` (RoPE must see global positions).
- Attention needs every key: the registered attention function (`ulysses_attention`, set on the model as
  `attn_implementation="twinkle_ulysses"`) turns q/k/v from [b, heads, s/sp, d] into [b, heads/sp, s, d]
  with one all-to-all over the sp group, runs SDPA over the whole sequence for its share of the heads and
  all-to-alls the output back (DeepSpeed-Ulysses). The all-to-all is its own adjoint, so backward sends the
  gradients back the same way. kv heads that sp does not divide are repeated to the query heads first.
- Masks are those of the whole sequence: Transformers hands a custom attention function no mask for a 2-D
  padding mask, and right padding (what `collate` makes, checked here) needs none, since plain causal
  attention is exact for every real token; a packed batch's 4-D block-causal mask is passed whole to every
  rank (Transformers passes 4-D masks through untouched), or built from the global position_ids.
- Each rank sums the token loss of its slice. Gradients, token counts and losses are combined over
  dp × fsdp × sp (`DeviceMesh.token_parallel_group`, every rank with different tokens): DDP/FSDP reduce over
  that group and the stepper normalises by its global trained tokens (see strategy.py), as torchtitan does
  over its dp_shard_cp mesh. The weights themselves are replicated over sp (or FSDP-sharded over fsdp × sp).

Refused before launch (mesh.py): sp not dividing the attention heads, models whose layers are not all full
softmax attention (linear-attention or sliding-window layers), sp with tensor or expert parallelism.
"""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F

from twinkle_core.parallel.process_group import all_reduce_sum

IGNORE_INDEX = -100
ATTENTION_NAME = "twinkle_ulysses"


def sp_model_problems(config, sp_size: int) -> list[str]:
    """Why `sp_size` cannot split this model's sequences (empty: it can). `config` is the text config."""
    problems = []
    other_layers = sorted({t for t in getattr(config, "layer_types", None) or () if t != "full_attention"})
    if other_layers:
        problems.append(f"sp_size={sp_size}: model_type {config.model_type!r} has {other_layers} layers; Ulysses "
                        "sequence parallelism splits full softmax attention only; use sp_size=1.")
    elif getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        problems.append(f"sp_size={sp_size}: model_type {config.model_type!r} attends within a sliding window "
                        f"({config.sliding_window} tokens), which sequence parallelism does not support yet; "
                        "use sp_size=1.")
    return problems


def sp_layout_problems(sizes: dict[str, int]) -> list[str]:
    """Layouts sequence parallelism cannot join (yet): TP and EP alongside."""
    sp = sizes.get("sp_size", 1)
    others = {name: sizes.get(name, 1) for name in ("tp_size", "ep_size") if sizes.get(name, 1) != 1}
    if sp == 1 or not others:
        return []
    listed = ", ".join(f"{name}={value}" for name, value in others.items())
    return [f"sp_size={sp} with {listed}: sequence parallelism combined with tensor/expert parallelism is not "
            "supported yet; use sp_size=1, or sp with dp/fsdp only (e.g. fsdp_size × sp_size = processes)."]


# ----- the batch -------------------------------------------------------------------------------------
def _pad_to(tensor: torch.Tensor, length: int, value) -> torch.Tensor:
    return F.pad(tensor, (0, length - tensor.shape[-1]), value=value)


def _is_right_padded(mask: torch.Tensor) -> bool:
    """Every row is 1s followed by 0s."""
    return bool((mask[:, 1:] <= mask[:, :-1]).all())


def _pad_square_mask(mask: torch.Tensor, length: int) -> torch.Tensor:
    """Grow a [b, 1, T, T] mask to [b, 1, L, L]: the new padding tokens see only themselves (no empty row)."""
    size = mask.shape[-1]
    if length == size:
        return mask
    blocked, allowed = (False, True) if mask.dtype == torch.bool else (torch.finfo(mask.dtype).min, 0)
    grown = mask.new_full((*mask.shape[:2], length, length), blocked)
    grown[..., :size, :size] = mask
    tail = torch.arange(size, length, device=mask.device)
    grown[..., tail, tail] = allowed
    return grown


def _block_causal(position_ids: torch.Tensor) -> torch.Tensor:
    """A boolean [b, 1, T, T] mask of packed samples (position_ids restart at 0): causal within each sample."""
    sample = torch.cumsum(position_ids == 0, dim=-1)
    steps = torch.arange(position_ids.shape[-1], device=position_ids.device)
    same = sample[:, :, None] == sample[:, None, :]
    return (same & (steps[:, None] >= steps[None, :]))[:, None]


def shard_batch(batch: dict[str, torch.Tensor], rank: int, size: int, pad_token_id: int) -> dict[str, torch.Tensor]:
    """This sp rank's contiguous slice of every sequence of a (padded) batch, with labels shifted globally.

    Returns input_ids, shift_labels and position_ids of the slice ([b, L/size], L = the length padded to a
    multiple of `size`), plus the whole sequence's 4-D attention_mask for packed batches.
    """
    if not 0 <= rank < size:
        raise ValueError(f"sp rank {rank} must be in 0 .. {size - 1}.")
    input_ids, labels = batch["input_ids"], batch["labels"]
    rows, length = input_ids.shape
    padded = -(-length // size) * size
    mask, position_ids = batch.get("attention_mask"), batch.get("position_ids")
    shift_labels = _pad_to(labels[:, 1:], padded, IGNORE_INDEX)
    if position_ids is None:
        position_ids = torch.arange(padded, device=input_ids.device).expand(rows, padded)
    else:
        position_ids = _pad_to(position_ids.expand(rows, length), padded, 0)
    full_mask = None
    if mask is not None and mask.dim() == 4:
        full_mask = _pad_square_mask(mask, padded)
    elif mask is not None and not _is_right_padded(mask):
        raise ValueError("sp_size > 1 needs right-padded rows (attention_mask 1s then 0s in each row, as collate "
                         "makes): causal attention over the whole sequence then equals the masked one; left-pad "
                         "or gaps are not supported, pass a 4-D mask for those.")
    elif mask is None and "position_ids" in batch and bool((position_ids[:, 1:] == 0).any()):
        full_mask = _block_causal(position_ids)  # packed without a mask: what Transformers infers in one process
    local = slice(rank * padded // size, (rank + 1) * padded // size)
    shard = {"input_ids": _pad_to(input_ids, padded, pad_token_id)[:, local],
             "shift_labels": shift_labels[:, local], "position_ids": position_ids[:, local]}
    if full_mask is not None:
        shard["attention_mask"] = full_mask
    return shard


# ----- attention -------------------------------------------------------------------------------------
class _AllToAll(torch.autograd.Function):
    """all_to_all_single over dim 0 in equal chunks; its gradient is the same exchange in reverse."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        tensor = tensor.contiguous()
        out = torch.empty_like(tensor)
        dist.all_to_all_single(out, tensor, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _AllToAll.apply(grad, ctx.group), None


def sequence_to_heads(x: torch.Tensor, group) -> torch.Tensor:
    """[b, h, s/P, d] on each rank (its slice, all heads) -> [b, h/P, s, d] (all positions, its heads)."""
    b, h, s, d = x.shape
    world = dist.get_world_size(group)
    chunks = x.reshape(b, world, h // world, s, d).transpose(0, 1)  # chunk j: the heads rank j attends with
    received = _AllToAll.apply(chunks, group)  # received[i]: rank i's slice of my heads
    return received.permute(1, 2, 0, 3, 4).reshape(b, h // world, world * s, d)


def heads_to_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """The inverse of sequence_to_heads: [b, h/P, s, d] -> [b, h, s/P, d]."""
    b, h, s, d = x.shape
    world = dist.get_world_size(group)
    chunks = x.reshape(b, h, world, s // world, d).permute(2, 0, 1, 3, 4)  # chunk j: rank j's slice
    received = _AllToAll.apply(chunks, group)  # received[i]: heads of rank i, my slice
    return received.transpose(0, 1).reshape(b, world * h, s // world, d)


def ulysses_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                      sliding_window=None, softcap=None, s_aux=None, *, group, **kwargs):
    """A Transformers attention function: SDPA over the whole sequence, each rank with 1/sp of the heads.

    `attention_mask` is None (causal over the whole, right-padded sequence) or the whole sequence's 4-D mask.
    """
    if sliding_window is not None or softcap is not None or s_aux is not None:
        raise ValueError(f"{type(module).__name__}: sliding-window, soft-capped or sink attention is not supported "
                         "with sp_size > 1; use sp_size=1.")
    world = dist.get_world_size(group)
    if key.shape[1] % world:  # kv heads sp does not divide: give each query head its own copy
        key = key.repeat_interleave(query.shape[1] // key.shape[1], dim=1)
        value = value.repeat_interleave(query.shape[1] // value.shape[1], dim=1)
    query, key, value = (sequence_to_heads(t, group) for t in (query, key, value))
    if key.shape[1] != query.shape[1]:  # grouped-query attention: the local share keeps the q/kv grouping
        key = key.repeat_interleave(query.shape[1] // key.shape[1], dim=1)
        value = value.repeat_interleave(query.shape[1] // value.shape[1], dim=1)
    is_causal = attention_mask is None and getattr(module, "is_causal", True)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                         scale=scaling, is_causal=is_causal)
    return heads_to_sequence(out, group).transpose(1, 2).contiguous(), None


class SequenceParallel:
    """One rank's part of the sp group: slices batches, runs Ulysses attention, sums over the group."""

    def __init__(self, group, rank: int, size: int):
        self.group, self.rank, self.size = group, rank, size

    @classmethod
    def from_mesh(cls, mesh) -> "SequenceParallel":
        return cls(mesh["sp"].get_group(), mesh.torch_mesh.get_local_rank("sp"), mesh.size("sp"))

    def apply(self, model: torch.nn.Module) -> None:
        """Make every attention layer of `model` (a Transformers model, before PEFT/DDP/FSDP) use Ulysses."""
        from transformers import AttentionInterface

        AttentionInterface.register(ATTENTION_NAME, functools.partial(ulysses_attention, group=self.group))
        if not model._can_set_attn_implementation():
            raise ValueError(f"sp_size={self.size}: {type(model).__name__} does not dispatch attention through "
                             "Transformers' AttentionInterface, so its sequences cannot be split; use sp_size=1.")
        model.set_attn_implementation(ATTENTION_NAME)

    def shard(self, batch: dict[str, torch.Tensor], pad_token_id: int) -> dict[str, torch.Tensor]:
        return shard_batch(batch, self.rank, self.size, pad_token_id)

    def sum(self, values: list[float]) -> list[float]:
        """Numbers summed over the sp group (each rank holds one slice of the same rows)."""
        return all_reduce_sum(values, self.group)
