"""Weighted blends of packed corpora, in Megatron-LM's `--data-path` syntax: "0.7 corpusA 0.3 corpusB".

Row r of the blend comes from component dataset_index[r], as that component's dataset_sample_index[r]-th
row: megatron-core's greedy error-minimising blend (helpers.build_blending_indices, the index its
BlendedDataset builds), so every prefix of the blend holds each component in proportion to its weight.
BlendedDataset itself is not used: it wants MegatronDataset components with their own config and builds
(and caches on disk) an index of one fixed size. The greedy choice of row r depends only on the rows
before it, so the index built here for the first N rows is a prefix of the one for any larger N: it grows
as steps ask for rows, and a resumed run gets the same rows for step k as an uninterrupted one.

A component's rows are its sequences in seeded per-epoch permutations (seed [seed, component]), as a
single corpus samples them. The validation split is the same blend of the components' validation splits.
A blend's folder holds only meta.json: the components' packed folders, their weights and counts.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from twinkle_core.data.pretrain import SPLITS, PackedSplit, make_batch, permuted_rows

MAX_COMPONENTS = 32767  # megatron's blending index stores the component as int16


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def parse_data_path(text: str) -> list[tuple[float, str]]:
    """[(weight, dataset id)] of "W1 PATH1 W2 PATH2 …"; a text not starting with a number is one corpus,
    weight 1 (a path may then hold spaces)."""
    parts = text.split()
    if len(parts) < 2 or not _is_number(parts[0]):
        return [(1.0, text)]
    if len(parts) % 2:
        raise ValueError(f"dataset={text!r}: a blend is weight, path pairs (e.g. \"0.7 a.jsonl 0.3 b\"); "
                         f"{len(parts)} words is an odd count.")
    pairs = []
    for weight, path in zip(parts[::2], parts[1::2]):
        if not _is_number(weight) or not float(weight) > 0:
            raise ValueError(f"dataset={text!r}: weight {weight!r} before {path!r} must be a positive number.")
        pairs.append((float(weight), path))
    if len(pairs) > MAX_COMPONENTS:
        raise ValueError(f"dataset={text!r}: {len(pairs)} corpora; a blend takes at most {MAX_COMPONENTS}.")
    return pairs


def normalized(weights) -> np.ndarray:
    weights = np.asarray(weights, dtype=np.float64)
    return weights / weights.sum()


def blending_indices(weights, size: int) -> tuple[np.ndarray, np.ndarray]:
    """(component, row within the component) of blend rows 0 … size-1, by megatron-core's greedy blend."""
    from megatron.core.datasets import helpers  # compiled with megatron-core; imported on use

    weights = normalized(weights)
    dataset_index = np.zeros(size, dtype=np.int16)
    sample_index = np.zeros(size, dtype=np.int64)
    helpers.build_blending_indices(dataset_index, sample_index, weights, len(weights), size, False)
    return dataset_index, sample_index


def write_blend(components: list[str | Path], weights: list[float], names: list[str], output_dir: str | Path) -> dict:
    """Write the blend folder `output_dir` (meta.json) over packed corpus folders; returns its meta."""
    if not len(components) == len(weights) == len(names) >= 2:
        raise ValueError(f"a blend needs at least 2 corpora with one weight and name each; got "
                         f"{len(components)} corpora, {len(weights)} weights, {len(names)} names.")
    metas = [json.loads((Path(c) / "meta.json").read_text()) for c in components]
    lengths = {m["seq_length"] for m in metas}
    if len(lengths) != 1:
        raise ValueError(f"the corpora of a blend must share seq_length; got {sorted(lengths)}.")
    parts = [{"dataset": name, "path": str(c), "weight": float(w), "sequences": m["sequences"], "tokens": m["tokens"]}
             for name, c, w, m in zip(names, components, normalized(weights), metas)]
    meta = {"seq_length": lengths.pop(), "blend": parts,
            **{key: {s: sum(p[key][s] for p in parts) for s in SPLITS} for key in ("sequences", "tokens")}}
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    partial = output_dir / "meta.json.partial"
    partial.write_text(json.dumps(meta, indent=2) + "\n")
    partial.replace(output_dir / "meta.json")
    return meta


@dataclass
class BlendedSplit:
    """A split of a blend: the PackedSplit interface (len, sequence, document_ids, step_indices,
    eval_indices, batch) over its components; sequence i is component c's sequence i - offsets[c]."""

    components: list[PackedSplit]
    weights: np.ndarray
    _dataset_index: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int16), init=False, repr=False)
    _sample_index: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64), init=False, repr=False)

    def __post_init__(self):
        self.weights = normalized(self.weights)
        self.offsets = np.concatenate([[0], np.cumsum([len(c) for c in self.components])]).astype(np.int64)
        self.seq_length = self.components[0].seq_length

    @classmethod
    def open(cls, directory: str | Path, split: str) -> "BlendedSplit":
        meta = json.loads((Path(directory) / "meta.json").read_text())
        return cls([PackedSplit.open(p["path"], split) for p in meta["blend"]], [p["weight"] for p in meta["blend"]])

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def _locate(self, index: int) -> tuple[PackedSplit, int]:
        component = int(np.searchsorted(self.offsets, index, side="right")) - 1
        return self.components[component], index - int(self.offsets[component])

    def sequence(self, index: int) -> np.ndarray:
        split, local = self._locate(index)
        return split.sequence(local)

    def document_ids(self, index: int) -> np.ndarray:
        split, local = self._locate(index)
        return split.document_ids(local)

    def rows(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """(component, row within it) of blend rows start … stop-1; the index doubles as it is outgrown."""
        if stop > self._dataset_index.size:
            self._dataset_index, self._sample_index = blending_indices(self.weights, max(stop, 2 * self._dataset_index.size))
        return self._dataset_index[start:stop], self._sample_index[start:stop]

    def step_indices(self, step: int, global_batch: int, seed: int) -> list[int]:
        """The blend's global rows step·G … step·G+G-1, as sequence numbers of the blend."""
        which, samples = self.rows(step * global_batch, (step + 1) * global_batch)
        out = np.zeros(global_batch, dtype=np.int64)
        for component in np.unique(which):
            picked = which == component
            n = len(self.components[component])
            out[picked] = np.asarray(permuted_rows(samples[picked].tolist(), n, [seed, int(component)])) + \
                self.offsets[component]
        return out.tolist()

    def eval_indices(self, rows: int, batches: int, seed: int) -> list[list[int]]:
        """The fixed held-out batches of `rows` sequences each (at most `batches`, at least one)."""
        return [self.step_indices(index, rows, seed) for index in range(min(batches, max(1, len(self) // rows)))]

    def batch(self, indices: list[int], document_masks: bool = True, mask_dtype: torch.dtype = torch.float32) -> dict:
        """As PackedSplit.batch."""
        return make_batch([self.sequence(i) for i in indices], [self.document_ids(i) for i in indices],
                          document_masks, mask_dtype)

