"""Truncate and batch encoded vision-language examples, keeping media tokens and pixel patches in step.

An example holds per-token lists (input_ids, labels, mm_token_type_ids) and per-medium data: flat pixel
patches with their grids (`image_grid_thw`, `video_grid_thw`, and `second_per_grid_ts` for Qwen videos).
The model checks that the media tokens equal the merged patches, so a cut never splits a medium: the
example ends before the first medium the cut would reach into, and that medium's patches (and later ones)
are dropped.
"""
from __future__ import annotations

import numpy as np
import torch

from .collate import collate
from .vision_encode import IMAGE, TEXT, VIDEO

MEDIA = ((IMAGE, "pixel_values", "image_grid_thw", ()), (VIDEO, "pixel_values_videos", "video_grid_thw",
                                                         ("second_per_grid_ts",)))
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
    for kind, *_ in MEDIA:
        for start, end in _runs(types, kind):
            if start < cut < end:
                cut = start
    out = {key: example[key][:cut] for key in TOKEN_KEYS}
    for kind, pixels_key, grid_key, extra in MEDIA:
        if grid_key not in example:
            continue
        kept = sum(1 for start, _ in _runs(types, kind) if start < cut)
        grids = example[grid_key][:kept]
        per_patch = len(example[pixels_key]) // max(1, sum(int(np.prod(g)) for g in example[grid_key]))
        out[pixels_key] = example[pixels_key][:per_patch * sum(int(np.prod(g)) for g in grids)]
        out[grid_key] = grids
        out.update({key: example[key][:kept] for key in extra})
    return out


def collate_vision(examples: list[dict], pad_token_id: int | None, mask_dtype: torch.dtype = torch.float32,
                   ) -> dict[str, torch.Tensor]:
    """Right-padded tokens (mm_token_type_ids padded as text) and every example's patches, in order."""
    batch = collate([{"input_ids": e["input_ids"], "labels": e["labels"]} for e in examples],
                    pad_token_id=pad_token_id, mask_dtype=mask_dtype)
    length = batch["input_ids"].shape[1]
    batch["mm_token_type_ids"] = torch.tensor(
        [list(e["mm_token_type_ids"]) + [TEXT] * (length - len(e["mm_token_type_ids"])) for e in examples])
    for _, pixels_key, grid_key, extra in MEDIA:
        grids = [list(grid) for e in examples for grid in (e.get(grid_key) or [])]
        if not grids:
            continue
        patches = sum(int(np.prod(grid)) for grid in grids)
        flat = np.concatenate([np.asarray(e.get(pixels_key) or [], dtype=np.float32) for e in examples])
        batch[pixels_key] = torch.from_numpy(flat.reshape(patches, -1))
        batch[grid_key] = torch.tensor(grids, dtype=torch.long)
        for key in extra:
            batch[key] = torch.tensor([value for e in examples for value in (e.get(key) or [])], dtype=torch.float32)
    return batch
