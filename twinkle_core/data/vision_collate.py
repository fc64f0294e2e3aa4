"""Truncate and batch encoded vision-language examples, keeping media tokens and pixel rows in step.

An example holds per-token lists (input_ids, labels, mm_token_type_ids) and, per medium kind, its pixel rows
flattened (`pixel_values`, `pixel_values_videos`), how many rows each medium has (`image_rows`,
`video_rows`), the shape of one row (`image_shape`, `video_shape`), and the model's per-medium extras
(Qwen's `image_grid_thw`, `video_grid_thw`, `second_per_grid_ts`). The model checks that its media tokens
match the visual features, so a cut never splits a medium: the example ends before the first medium the cut
would reach into, and that medium's pixels (and later ones) are dropped.
"""
from __future__ import annotations

import numpy as np
import torch

from .collate import collate
from .packing import concat_samples, pack_groups
from .vision_encode import IMAGE, MEDIA_KEYS, TEXT, VIDEO

EXTRAS = {IMAGE: ("image_grid_thw",), VIDEO: ("video_grid_thw", "second_per_grid_ts")}
TOKEN_KEYS = ("input_ids", "labels", "mm_token_type_ids")
BATCH_KEYS = ("input_ids", "labels", "attention_mask", "mm_token_type_ids")


def _runs(types: list[int], kind: int) -> list[tuple[int, int]]:
    """(start, end) of each consecutive run of `kind` tokens: one per medium."""
    runs, start = [], None
    for position, value in enumerate(list(types) + [TEXT]):
        if value == kind and start is None:
            start = position
        elif value != kind and start is not None:
            runs.append((start, position))
            start = None
    return runs


def truncate_vision(example: dict, max_length: int | None) -> dict:
    """The first `max_length` tokens, cut before any medium the cut would split, with the media kept."""
    if max_length is None or len(example["input_ids"]) <= max_length:
        return example
    types, cut = example["mm_token_type_ids"], max_length
    for kind in MEDIA_KEYS:
        for start, end in _runs(types, kind):
            if start < cut < end:
                cut = start
    out = dict(example)
    out.update({key: example[key][:cut] for key in TOKEN_KEYS})
    for kind, (pixels_key, rows_key, _) in MEDIA_KEYS.items():
        kept = sum(1 for start, _ in _runs(types, kind) if start < cut)
        rows = example[rows_key]
        per_row = len(example[pixels_key]) // max(1, sum(rows))
        out[pixels_key] = example[pixels_key][:per_row * sum(rows[:kept])]
        out[rows_key] = rows[:kept]
        out.update({key: example[key][:kept] for key in EXTRAS[kind] if key in example})
    return out


def pack_vision_examples(examples: list[dict], max_length: int) -> list[dict]:
    """Examples concatenated in order into sequences of at most `max_length` tokens, as `pack_examples` packs
    text (position_ids restart at 0 for each sample, each sample's first label is not trained), with their
    media in the same order: pixel rows, rows per medium and the per-medium extras. A model with 3-D M-RoPE
    positions gets them from the training objective (twinkle_core.objectives.vision), per sample."""
    packs = []
    for group in pack_groups([len(e["input_ids"]) for e in examples], max_length):
        samples = [examples[i] for i in group]
        packed = {**concat_samples(samples), "mm_token_type_ids": [t for e in samples for t in e["mm_token_type_ids"]]}
        for kind, (pixels_key, rows_key, shape_key) in MEDIA_KEYS.items():
            with_media = [e for e in samples if e.get(rows_key)]
            packed[pixels_key] = [value for e in with_media for value in e[pixels_key]]
            packed[rows_key] = [rows for e in with_media for rows in e[rows_key]]
            packed[shape_key] = list(with_media[0][shape_key]) if with_media else []
            for key in EXTRAS[kind]:
                if key in samples[0]:
                    packed[key] = [value for e in with_media for value in e[key]]
        packs.append(packed)
    return packs


def collate_vision(examples: list[dict], pad_token_id: int | None, mask_dtype: torch.dtype = torch.float32,
                   ) -> dict[str, torch.Tensor]:
    """Right-padded tokens (mm_token_type_ids padded as text) and every example's pixel rows, in order.
    Packed examples also get position_ids and the block-causal mask (twinkle_core.data.collate)."""
    keys = ("input_ids", "labels", "position_ids") if "position_ids" in examples[0] else ("input_ids", "labels")
    batch = collate([{key: e[key] for key in keys} for e in examples], pad_token_id=pad_token_id,
                    mask_dtype=mask_dtype)
    length = batch["input_ids"].shape[1]
    batch["mm_token_type_ids"] = torch.tensor(
        [list(e["mm_token_type_ids"]) + [TEXT] * (length - len(e["mm_token_type_ids"])) for e in examples])
    for kind, (pixels_key, rows_key, shape_key) in MEDIA_KEYS.items():
        with_media = [e for e in examples if e.get(rows_key)]
        if not with_media:
            continue
        flat = np.concatenate([np.asarray(e[pixels_key], dtype=np.float32) for e in with_media])
        batch[pixels_key] = torch.from_numpy(flat.reshape(-1, *with_media[0][shape_key]))
        for key in EXTRAS[kind]:
            if key in with_media[0]:
                values = [value for e in with_media for value in e[key]]
                batch[key] = torch.tensor(values, dtype=torch.float32 if key == "second_per_grid_ts" else torch.long)
    return batch
