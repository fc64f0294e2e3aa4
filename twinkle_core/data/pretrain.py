"""Pre-training corpora in Megatron-LM's indexed format: `{"text": ...}` rows tokenised once (or a
tokenised `PREFIX.bin`/`PREFIX.idx` corpus taken as it is), packed into fixed-length sequences, with
document boundaries, a train/validation split and resumable sampling.

A packed corpus is one folder (written under a temporary name and renamed when complete):

    train.bin / train.idx                    megatron-core IndexedDataset of the training documents
    validation.bin / validation.idx          the same for the held-out documents
    meta.json                                sequence length, counts per split, the source

`pack_text_corpus` streams a text corpus through tokenizer worker processes into those files with
megatron-core's IndexedDatasetBuilder (one document, EOS-terminated, per good row). `split_indexed_corpus`
takes an existing Megatron-LM corpus (`--data-path PREFIX`): it writes no tokens, only `train.docs.npy`
/ `validation.docs.npy` (which of the source's sequences each split holds); the split reads the source
`.bin` in place. Either way a document is one sequence of the IndexedDataset, as in megatron's GPTDataset,
and the split is the same seeded rule (`_is_validation`) on each document's index.

Sequence i of a split is its documents' tokens back to back, [i·S, (i+1)·S) (the tail shorter than S is
dropped), so a sequence may hold the end of one document and the start of the next. With `document_masks`
the attention of each position is kept inside its own document (a block-causal mask); otherwise it is
plain causal, as in Megatron-LM without `--reset-attention-mask`. Every token is trained. Positions run on
across documents (megatron's local spec rotates by sequence position).

Sampling is a seeded permutation of the sequences per epoch; step k takes global rows k·G … k·G+G-1 of the
concatenated epochs, so a resumed run asks for step k and gets the same rows as an uninterrupted one.
A weighted blend of packed corpora (twinkle_core.data.blend) samples its rows the same way.
"""
from __future__ import annotations

import hashlib
import json
import multiprocessing
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import torch

from twinkle_core.atomic import atomic_dir
from twinkle_core.data.encode import encode_text
from twinkle_core.data.formats import get_row_format
from twinkle_core.data.parallel import check_num_proc, map_chunks
from twinkle_core.data.readers import read_record_chunks
from twinkle_core.data.rows import LOGGED_BAD_ROWS, BadRow, check_fraction, check_records, report_bad_rows

SPLITS = ("train", "validation")
CHUNK_ROWS = 1000  # rows per worker task: large enough to amortise the hand-over, small enough to stream
HASH_SAMPLES = 64  # 1 MiB blocks of a .bin read for its content hash
HASH_BLOCK = 1 << 20


def _is_validation(index: int, seed: int, fraction: float) -> bool:
    digest = hashlib.sha256(f"{seed}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def _check_split_options(seq_length: int, validation_fraction: float) -> None:
    if seq_length < 2:
        raise ValueError(f"seq_length={seq_length} must be at least 2.")
    if not 0.0 < validation_fraction < 1.0:
        raise ValueError(f"validation_fraction={validation_fraction} must be between 0 and 1 (e.g. 0.1).")


def _indexed():
    """megatron-core's indexed dataset module (imported on use: megatron takes seconds to import)."""
    from megatron.core.datasets import indexed_dataset

    return indexed_dataset


# ----- a Megatron-LM corpus given as a prefix -----------------------------------------------------------

def is_indexed_prefix(path: str | Path) -> bool:
    """Whether `path` names a Megatron-LM corpus: PREFIX.bin and PREFIX.idx exist (PREFIX itself need not)."""
    return all(Path(f"{path}{suffix}").is_file() for suffix in (".bin", ".idx"))


def check_indexed_prefix(prefix: str | Path) -> None:
    """Raise, naming the prefix and the missing file, unless PREFIX.bin and PREFIX.idx both exist."""
    missing = [f"{prefix}{s}" for s in (".bin", ".idx") if not Path(f"{prefix}{s}").is_file()]
    if missing:
        raise FileNotFoundError(f"Megatron corpus prefix {str(prefix)!r}: {', '.join(missing)} not found; a "
                                "prefix names PREFIX.bin and PREFIX.idx (written by Megatron-LM's "
                                "tools/preprocess_data.py or IndexedDatasetBuilder).")


def indexed_corpus_hash(prefix: str | Path) -> str:
    """Content hash of a Megatron corpus: all of the .idx (small: 12-20 bytes a document; any change of a
    document's length changes it) plus the .bin's size and HASH_SAMPLES evenly spaced 1 MiB blocks, so a
    multi-GB .bin costs a fraction of a second rather than a full read. An edit that keeps every length
    and misses every sampled block goes unseen; the download cache is keyed on size and mtime besides."""
    check_indexed_prefix(prefix)
    digest = hashlib.sha256()
    with open(f"{prefix}.idx", "rb") as idx:
        for block in iter(lambda: idx.read(HASH_BLOCK), b""):
            digest.update(block)
    size = Path(f"{prefix}.bin").stat().st_size
    digest.update(str(size).encode())
    with open(f"{prefix}.bin", "rb") as data:
        for offset in sorted({int(i * max(0, size - HASH_BLOCK) / max(1, HASH_SAMPLES - 1))
                              for i in range(HASH_SAMPLES)}):
            data.seek(offset)
            digest.update(data.read(HASH_BLOCK))
    return digest.hexdigest()


def _open_indexed(prefix: str | Path):
    check_indexed_prefix(prefix)
    try:
        return _indexed().IndexedDataset(str(prefix), mmap=True)
    except (AssertionError, ValueError, KeyError) as error:  # megatron asserts on a bad header or version
        raise ValueError(f"Megatron corpus prefix {str(prefix)!r}: not a readable IndexedDataset ({error}); "
                         "rebuild it with Megatron-LM's tools/preprocess_data.py.") from None


def _max_token_id(dataset) -> int:
    tokens = _all_tokens(dataset)
    step = 1 << 26  # in pieces: the maximum of a multi-GB memory map without a multi-GB temporary
    return max((int(tokens[i:i + step].max()) for i in range(0, tokens.size, step)), default=-1)


def split_indexed_corpus(prefix: str | Path, seq_length: int, output_dir: str | Path, vocab_size: int,
                         validation_fraction: float = 0.1, seed: int = 0) -> Path:
    """Split the documents of the Megatron corpus `prefix` into train/validation; returns `output_dir`.

    Only the document numbers of each split are written: the source .bin may be many GB, and the splits
    read it in place (the packed folder's meta.json names the prefix it depends on)."""
    _check_split_options(seq_length, validation_fraction)
    dataset = _open_indexed(prefix)
    count = len(dataset)
    if count < 2:
        raise ValueError(f"Megatron corpus prefix {str(prefix)!r}: {count} document(s); a train/validation "
                         "split needs at least 2.")
    top = _max_token_id(dataset)
    if top >= vocab_size:
        raise ValueError(f"Megatron corpus prefix {str(prefix)!r}: token id {top} does not fit the model's "
                         f"vocabulary of {vocab_size}; it was tokenised for another model: tokenise the text "
                         "again with this model's tokenizer (or pass the .jsonl).")
    held = np.fromiter((_is_validation(i, seed, validation_fraction) for i in range(count)), bool, count)
    if not held.any() or held.all():  # small corpora: at least one document on each side
        held[:] = False
        held[-1] = True
    lengths = dataset.sequence_lengths.astype(np.int64)
    meta = {"seq_length": seq_length, "source": str(prefix), "prefix": str(Path(prefix).resolve()),
            "documents": {}, "tokens": {}, "sequences": {}}
    with atomic_dir(output_dir) as partial_dir:
        for split, picked in zip(SPLITS, (~held, held)):
            np.save(partial_dir / f"{split}.docs.npy", np.flatnonzero(picked).astype(np.int64))
            _count(meta, split, int(picked.sum()), int(lengths[picked].sum()), seq_length, prefix)
        (partial_dir / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return Path(output_dir)


# ----- a {"text": ...} corpus, tokenised ---------------------------------------------------------------

_TOKENIZER: Any = None  # the tokenizer forked workers inherit (set while pack_text_corpus runs)


def _encode_chunk(tokenizer, source: str, chunk: list[tuple[int, Any]]) -> tuple[list[np.ndarray], list[BadRow]]:
    """The int32 token ids of every good row of the chunk, in order, and its bad rows."""
    tokenizer, bad = tokenizer or _TOKENIZER, []
    rows = check_records(chunk, get_row_format("text"), source, Path(source).parent, bad)
    return [np.asarray(encode_text(tokenizer, row["text"])["input_ids"], dtype=np.int32) for _, row in rows], bad


@dataclass
class _SplitWriter:
    """Streams documents into train/validation builders by the split rule, holding back only what the
    'at least one document each side' rule may still move: the latest document, and held-out documents
    while no training document has come (a tiny corpus, or one where every document is held out)."""

    builders: dict
    seed: int
    fraction: float
    good: int = 0
    documents: dict = field(default_factory=lambda: dict.fromkeys(SPLITS, 0))
    tokens: dict = field(default_factory=lambda: dict.fromkeys(SPLITS, 0))
    waiting: list = field(default_factory=list)  # held-out documents written once a training one is
    last: tuple | None = None  # (held out?, ids) of the latest document

    def add(self, ids: np.ndarray) -> None:
        if self.last is not None:
            self._place(*self.last)
        self.last = (_is_validation(self.good, self.seed, self.fraction), ids)
        self.good += 1

    def finish(self) -> None:
        if self.last is None:
            return
        held, ids = self.last
        if held and not self.documents["train"]:  # every document held out: all but the last train
            for waiting in self.waiting:
                self._write("train", waiting)
            self.waiting = []
        elif not held and not self.documents["validation"] and not self.waiting:  # none held out
            held = True
        self._place(held, ids)

    def _place(self, held: bool, ids: np.ndarray) -> None:
        if held and not self.documents["train"]:
            self.waiting.append(ids)
            return
        self._write("validation" if held else "train", ids)
        if not held:
            for waiting in self.waiting:
                self._write("validation", waiting)
            self.waiting = []

    def _write(self, split: str, ids: np.ndarray) -> None:
        self.builders[split].add_document(ids, [ids.size])
        self.documents[split] += 1
        self.tokens[split] += int(ids.size)


def pack_text_corpus(path: str | Path, tokenizer, seq_length: int, output_dir: str | Path,
                     validation_fraction: float = 0.1, seed: int = 0, max_bad_fraction: float = 0.01,
                     num_proc: int | None = None, chunk_rows: int = CHUNK_ROWS) -> Path:
    """Tokenise every document of `path` into the packed corpus folder `output_dir` (megatron-core's
    IndexedDataset per split), in `num_proc` worker processes; returns it. The result does not depend on
    num_proc or chunk_rows."""
    global _TOKENIZER
    _check_split_options(seq_length, validation_fraction)
    check_fraction(max_bad_fraction)
    num_proc, path = check_num_proc(num_proc), Path(path)
    dtype = _indexed().DType.optimal_dtype(len(tokenizer))  # uint16 below 65500 ids, as preprocess_data.py
    # forked workers inherit the tokenizer from the module; spawned ones get it with each chunk
    forked = "fork" in multiprocessing.get_all_start_methods()
    encode = partial(_encode_chunk, None if forked else tokenizer, str(path))
    bad, num_bad = [], 0
    with atomic_dir(output_dir) as partial_dir:
        builders = {s: _indexed().IndexedDatasetBuilder(str(partial_dir / f"{s}.bin"), dtype=dtype) for s in SPLITS}
        writer = _SplitWriter(builders, seed, validation_fraction)
        _TOKENIZER = tokenizer
        try:
            for documents, chunk_bad in map_chunks(encode, read_record_chunks(path, chunk_rows), num_proc):
                num_bad += len(chunk_bad)
                bad.extend(chunk_bad[:LOGGED_BAD_ROWS - len(bad)])
                for ids in documents:
                    writer.add(ids)
        finally:
            _TOKENIZER = None
        report_bad_rows(bad, writer.good + num_bad, max_bad_fraction, str(path), num_bad)
        if writer.good < 2:
            raise ValueError(f"{path}: {writer.good} document(s); a train/validation split needs at least 2.")
        writer.finish()
        meta = {"seq_length": seq_length, "source": str(path), "documents": {}, "tokens": {}, "sequences": {}}
        for split in SPLITS:
            builders[split].finalize(str(partial_dir / f"{split}.idx"))
            _count(meta, split, writer.documents[split], writer.tokens[split], seq_length, path)
        (partial_dir / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return Path(output_dir)


def _count(meta: dict, split: str, documents: int, tokens: int, seq_length: int, source) -> None:
    meta["documents"][split], meta["tokens"][split] = documents, tokens
    meta["sequences"][split] = tokens // seq_length
    if meta["sequences"][split] == 0:
        raise ValueError(f"{source}: the {split} split has {tokens} tokens, fewer than one sequence of "
                         f"seq_length={seq_length}; use a shorter seq_length or a larger corpus.")


# ----- reading a split ---------------------------------------------------------------------------------

def _all_tokens(dataset) -> np.ndarray:
    """Every token of an IndexedDataset's .bin, a view of its memory map (no copy)."""
    count = int(dataset.sequence_lengths.sum(dtype=np.int64))
    return dataset.bin_reader.read(dtype=dataset.index.dtype, count=count, offset=0)


def open_split(directory: str | Path, split: str):
    """The `split` of a packed corpus folder: a PackedSplit, or a BlendedSplit for a blend's folder."""
    meta = _read_meta(directory)
    if "blend" in meta:
        from twinkle_core.data.blend import BlendedSplit

        return BlendedSplit.open(directory, split)
    return PackedSplit.open(directory, split)


def _read_meta(directory: str | Path) -> dict:
    directory = Path(directory)
    if not (directory / "meta.json").is_file():
        raise FileNotFoundError(f"{directory} is not a packed corpus (no meta.json); pack it with "
                                "pack_text_corpus first.")
    return json.loads((directory / "meta.json").read_text())


def permuted_rows(rows: Iterable[int], n: int, seed: list[int]) -> list[int]:
    """Global rows of a stream of seeded per-epoch permutations of n items: row r is item
    perm_{r // n}[r % n], each epoch's permutation drawn from default_rng([*seed, epoch])."""
    perms: dict[int, np.ndarray] = {}
    out = []
    for row in rows:
        epoch = row // n
        if epoch not in perms:
            perms[epoch] = np.random.default_rng([*seed, epoch]).permutation(n)
        out.append(int(perms[epoch][row % n]))
    return out


@dataclass
class PackedSplit:
    """One split of a packed corpus, memory-mapped: sequences, their documents, seeded sampling.

    `tokens` is the whole .bin; the split's stream is its documents back to back, document d starting at
    doc_starts[d] in the stream and at doc_offsets[d] in `tokens` (None: the same, the .bin holds exactly
    the split's documents in order)."""

    tokens: np.ndarray
    doc_starts: np.ndarray
    seq_length: int
    doc_offsets: np.ndarray | None = None
    num_tokens: int | None = None  # of the split's stream; None: tokens.size
    dataset: Any = None  # the IndexedDataset whose memory map `tokens` views: kept open while this lives

    @classmethod
    def open(cls, directory: str | Path, split: str) -> "PackedSplit":
        if split not in SPLITS:
            raise ValueError(f"split={split!r}: choose one of {SPLITS}.")
        directory = Path(directory)
        meta = _read_meta(directory)
        if "prefix" in meta:  # documents picked out of a Megatron corpus read in place
            return cls.from_indexed(_open_indexed(meta["prefix"]), meta["seq_length"],
                                    np.load(directory / f"{split}.docs.npy"))
        return cls.from_indexed(_open_indexed(directory / split), meta["seq_length"])

    @classmethod
    def from_indexed(cls, dataset, seq_length: int, documents: np.ndarray | None = None) -> "PackedSplit":
        """A split over an IndexedDataset: all its documents, or those numbered in `documents`."""
        lengths = dataset.sequence_lengths.astype(np.int64)
        offsets = dataset.index.sequence_pointers // dataset.index.dtype_size
        if documents is not None:
            lengths, offsets = lengths[documents], offsets[documents]
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
        contiguous = documents is None and np.array_equal(starts, offsets)
        return cls(_all_tokens(dataset), starts, seq_length, None if contiguous else offsets,
                   int(lengths.sum()), dataset)

    def __len__(self) -> int:
        size = self.tokens.size if self.num_tokens is None else self.num_tokens
        return int(size // self.seq_length)

    def sequence(self, index: int) -> np.ndarray:
        start = index * self.seq_length
        if self.doc_offsets is None:
            return np.asarray(self.tokens[start:start + self.seq_length], dtype=np.int64)
        return self._gather(start, start + self.seq_length)

    def _gather(self, start: int, stop: int) -> np.ndarray:
        """Stream positions [start, stop) from the documents that hold them."""
        first = int(np.searchsorted(self.doc_starts, start, side="right")) - 1
        last = int(np.searchsorted(self.doc_starts, stop, side="left"))
        pieces = []
        for doc in range(first, last):
            lo = max(start, int(self.doc_starts[doc]))
            hi = stop if doc + 1 == len(self.doc_starts) else min(stop, int(self.doc_starts[doc + 1]))
            begin = int(self.doc_offsets[doc]) + lo - int(self.doc_starts[doc])
            pieces.append(self.tokens[begin:begin + max(0, hi - lo)])
        return np.concatenate(pieces).astype(np.int64)

    def document_ids(self, index: int) -> np.ndarray:
        """Which document each position of sequence `index` belongs to (a running document number)."""
        positions = index * self.seq_length + np.arange(self.seq_length)
        return np.searchsorted(self.doc_starts, positions, side="right")

    def step_indices(self, step: int, global_batch: int, seed: int) -> list[int]:
        """The sequences of global rows step·G … step·G+G-1 over seeded per-epoch permutations."""
        return permuted_rows(range(step * global_batch, (step + 1) * global_batch), len(self), [seed])

    def eval_indices(self, rows: int, batches: int, seed: int) -> list[list[int]]:
        """The fixed held-out batches of `rows` sequences each (at most `batches`, at least one)."""
        return [self.step_indices(index, rows, seed) for index in range(min(batches, max(1, len(self) // rows)))]

    def batch(self, indices: list[int], document_masks: bool = True, mask_dtype: torch.dtype = torch.float32) -> dict:
        """input_ids and labels [B, S] (every token trained), and a [B, 1, S, S] block-causal additive mask
        (0 = attend) with `document_masks`, else a [B, S] all-ones mask (causal)."""
        return make_batch([self.sequence(i) for i in indices], [self.document_ids(i) for i in indices],
                          document_masks, mask_dtype)


def make_batch(sequences: list[np.ndarray], documents: list[np.ndarray], document_masks: bool = True,
               mask_dtype: torch.dtype = torch.float32) -> dict:
    """A training batch of sequences and their document ids (see PackedSplit.batch)."""
    ids = torch.from_numpy(np.stack(sequences))
    batch = {"input_ids": ids, "labels": ids.clone()}
    if not document_masks:
        batch["attention_mask"] = torch.ones_like(ids)
        return batch
    docs = torch.from_numpy(np.stack(documents))
    seq_length = ids.shape[1]
    causal = torch.ones(seq_length, seq_length, dtype=torch.bool).tril()
    allowed = causal & (docs[:, :, None] == docs[:, None, :])
    mask = torch.zeros(allowed.shape, dtype=mask_dtype).masked_fill(~allowed, torch.finfo(mask_dtype).min)
    batch["attention_mask"] = mask[:, None]
    return batch
