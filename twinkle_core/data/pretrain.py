"""Pre-training corpora: `{"text": ...}` rows tokenised once into memory-mapped token streams, packed into
fixed-length sequences, with document boundaries, a train/validation split and resumable sampling.

On disk (one folder, written under a temporary name and renamed when complete):

    train.tokens.npy / validation.tokens.npy   uint32 token ids of the documents, back to back (EOS ends each)
    train.docs.npy / validation.docs.npy       int64 start offset of every document in its stream
    meta.json                                  sequence length, counts, the source's content hash

Sequence i of a split is tokens[i·S : (i+1)·S] (the tail shorter than S is dropped), so a sequence may hold
the end of one document and the start of the next. With `document_masks` the attention of each position is
kept inside its own document (a block-causal mask); otherwise it is plain causal, as in Megatron-LM
without `--reset-attention-mask`. Every token is trained. Positions run on across documents (megatron's
local spec rotates by sequence position).

Sampling is a seeded permutation of the sequences per epoch; step k takes global rows k·G … k·G+G-1 of the
concatenated epochs, so a resumed run asks for step k and gets the same rows as an uninterrupted one.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from twinkle_core.data.encode import encode_text
from twinkle_core.data.rows import load_rows

SPLITS = ("train", "validation")


def _is_validation(index: int, seed: int, fraction: float) -> bool:
    digest = hashlib.sha256(f"{seed}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def pack_text_corpus(path: str | Path, tokenizer, seq_length: int, output_dir: str | Path,
                     validation_fraction: float = 0.1, seed: int = 0, max_bad_fraction: float = 0.01) -> Path:
    """Tokenise every document of `path` and write the packed corpus folder `output_dir`; returns it."""
    if seq_length < 2:
        raise ValueError(f"seq_length={seq_length} must be at least 2.")
    if not 0.0 < validation_fraction < 1.0:
        raise ValueError(f"validation_fraction={validation_fraction} must be between 0 and 1 (e.g. 0.1).")
    rows = load_rows(path, "text", max_bad_fraction).rows
    if len(rows) < 2:
        raise ValueError(f"{path}: {len(rows)} document(s); a train/validation split needs at least 2.")
    documents = [encode_text(tokenizer, row["text"])["input_ids"] for row in rows]
    held = [i for i in range(len(documents)) if _is_validation(i, seed, validation_fraction)]
    if not held or len(held) == len(documents):  # small corpora: at least one document on each side
        held = [len(documents) - 1]
    output_dir = Path(output_dir)
    partial = output_dir.with_name(output_dir.name + f".partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    meta = {"seq_length": seq_length, "documents": {}, "tokens": {}, "sequences": {}, "source": str(path)}
    held_set = set(held)
    for split in SPLITS:
        docs = [d for i, d in enumerate(documents) if (i in held_set) == (split == "validation")]
        tokens = np.fromiter((t for d in docs for t in d), dtype=np.uint32)
        starts = np.cumsum([0] + [len(d) for d in docs[:-1]]).astype(np.int64)
        np.save(partial / f"{split}.tokens.npy", tokens)
        np.save(partial / f"{split}.docs.npy", starts)
        meta["documents"][split], meta["tokens"][split] = len(docs), int(tokens.size)
        meta["sequences"][split] = int(tokens.size // seq_length)
        if meta["sequences"][split] == 0:
            raise ValueError(f"{path}: the {split} split has {tokens.size} tokens, fewer than one sequence of "
                             f"seq_length={seq_length}; use a shorter seq_length or a larger corpus.")
    (partial / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    shutil.rmtree(output_dir, ignore_errors=True)
    partial.rename(output_dir)
    return output_dir


@dataclass
class PackedSplit:
    """One split of a packed corpus, memory-mapped: sequences, their documents, seeded sampling."""

    tokens: np.ndarray
    doc_starts: np.ndarray
    seq_length: int

    @classmethod
    def open(cls, directory: str | Path, split: str) -> "PackedSplit":
        if split not in SPLITS:
            raise ValueError(f"split={split!r}: choose one of {SPLITS}.")
        directory = Path(directory)
        if not (directory / "meta.json").is_file():
            raise FileNotFoundError(f"{directory} is not a packed corpus (no meta.json); pack it with "
                                    "pack_text_corpus first.")
        meta = json.loads((directory / "meta.json").read_text())
        return cls(np.load(directory / f"{split}.tokens.npy", mmap_mode="r"),
                   np.load(directory / f"{split}.docs.npy"), meta["seq_length"])

    def __len__(self) -> int:
        return int(self.tokens.size // self.seq_length)

    def sequence(self, index: int) -> np.ndarray:
        start = index * self.seq_length
        return np.asarray(self.tokens[start:start + self.seq_length], dtype=np.int64)

    def document_ids(self, index: int) -> np.ndarray:
        """Which document each position of sequence `index` belongs to (a running document number)."""
        positions = index * self.seq_length + np.arange(self.seq_length)
        return np.searchsorted(self.doc_starts, positions, side="right")

    def step_indices(self, step: int, global_batch: int, seed: int) -> list[int]:
        """The sequences of global rows step·G … step·G+G-1 over seeded per-epoch permutations."""
        n = len(self)
        rows = range(step * global_batch, (step + 1) * global_batch)
        perms: dict[int, np.ndarray] = {}
        out = []
        for row in rows:
            epoch = row // n
            if epoch not in perms:
                perms[epoch] = np.random.default_rng([seed, epoch]).permutation(n)
            out.append(int(perms[epoch][row % n]))
        return out

    def eval_indices(self, rows: int, batches: int, seed: int) -> list[list[int]]:
        """The fixed held-out batches of `rows` sequences each (at most `batches`, at least one)."""
        return [self.step_indices(index, rows, seed) for index in range(min(batches, max(1, len(self) // rows)))]

    def batch(self, indices: list[int], document_masks: bool = True, mask_dtype: torch.dtype = torch.float32) -> dict:
        """input_ids and labels [B, S] (every token trained), and a [B, 1, S, S] block-causal additive mask
        (0 = attend) with `document_masks`, else a [B, S] all-ones mask (causal)."""
        ids = torch.from_numpy(np.stack([self.sequence(i) for i in indices]))
        batch = {"input_ids": ids, "labels": ids.clone()}
        if not document_masks:
            batch["attention_mask"] = torch.ones_like(ids)
            return batch
        docs = torch.from_numpy(np.stack([self.document_ids(i) for i in indices]))
        causal = torch.ones(self.seq_length, self.seq_length, dtype=torch.bool).tril()
        allowed = causal & (docs[:, :, None] == docs[:, None, :])
        mask = torch.zeros(allowed.shape, dtype=mask_dtype).masked_fill(~allowed, torch.finfo(mask_dtype).min)
        batch["attention_mask"] = mask[:, None]
        return batch
