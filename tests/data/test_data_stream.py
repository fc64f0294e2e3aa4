"""Streaming, parallel tokenisation and lazily read rows: the same results as the one-core encoding before them."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from vision_models import save_tiny_qwen2_5_vl

from twinkle_core.data import DatasetError, load_tokenized, tokenize_dataset
from twinkle_core.data.parallel import map_chunks
from twinkle_core.parallel.data import local_micro_batches

BUNDLED = Path(__file__).resolve().parents[2] / "twinkle_core" / "datasets"

# sha256 (first 16 hex digits) of every stored row, columns sorted, values as JSON, and the (rows, tokens, trained
# tokens) counts, as the one-core, all-in-memory encoding of commit a3ee8b1 stored them (tiny test tokenizers).
BEFORE = {
    "self_cognition/train/chat/False/512": ("18132e125ad81e33", 210, 13022, 7650),
    "self_cognition/train/chat/True/512": ("06ca6730d62cc565", 27, 13022, 7650),
    "nova/train/chat/False/64": ("6cb753f5f14cdba4", 210, 13083, 8126),
    "arithmetic/train/prompts/False/512": ("4447e6ccfe4acb7b", 336, 15696, 15696),
    "preference/train/preference/False/512": ("3680f616710c0a37", 210, 27724, 16040),
    "retrieval/train/pairs/False/512": ("ba55c49137651eca", 360, 62521, 62521),
    "vision_shapes/train/vision_chat/False/128": ("a9287a18219fb409", 170, 15880, 1112),
    "vision_shapes/train/vision_chat/True/512": ("c0d548aedfe6dee9", 34, 15880, 1112),
    "self_cognition/heldout/chat/False/512": ("d668e295eddb7168", 32, 2136, 1117),
    "self_cognition/heldout/chat/True/512": ("2aa1f0c235b91923", 5, 2136, 1117),
    "nova/heldout/chat/False/64": ("d1b8b5d2e0d8cf39", 32, 2009, 1072),
    "arithmetic/heldout/prompts/False/512": ("7deab35f290fa34c", 64, 2989, 2989),
    "preference/heldout/preference/False/512": ("e5d0fe80ab6a8fda", 32, 4528, 2330),
    "retrieval/heldout/pairs/False/512": ("a05b263102399efa", 216, 38452, 38452),
    "vision_shapes/heldout/vision_chat/False/128": ("c3085d13e13fc221", 56, 5194, 369),
    "vision_shapes/heldout/vision_chat/True/512": ("de631fca7fa0261e", 12, 5194, 369),
    "pretrain/corpus/text/True/256": ("15524acfa0313999", 21, 3876, 3846),
}


def _digest(rows) -> str:
    digest = hashlib.sha256()
    for row in rows:
        for key in sorted(row):
            value = row[key].tolist() if isinstance(row[key], np.ndarray) else row[key]
            digest.update(key.encode())
            digest.update(json.dumps(value).encode())
    return digest.hexdigest()[:16]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory, tokenizer):
    text = tmp_path_factory.mktemp("tokenizer")
    tokenizer.save_pretrained(text)
    return {"text": text, "vision": save_tiny_qwen2_5_vl(tmp_path_factory.mktemp("qwen2_5_vl"))}


@pytest.mark.parametrize("workers", [{}, {"num_proc": 2, "chunk_rows": 7}], ids=["one-process", "two-workers"])
def test_every_bundled_set_encodes_bit_identically_to_before(workers, model_dirs):
    for case, (digest, rows, tokens, trained) in BEFORE.items():
        name, split, kind, packing, max_length = case.split("/")
        model_dir = model_dirs["vision" if kind == "vision_chat" else "text"]
        path = BUNDLED / name / (f"{split}.jsonl" if name != "pretrain" else "corpus.jsonl")
        result = tokenize_dataset(path, model_dir, kind=kind, max_length=int(max_length), packing=packing == "True",
                                  max_bad_fraction=1.0, **workers)
        assert (result.num_rows, result.num_tokens, result.num_trained_tokens) == (rows, tokens, trained), case
        assert _digest(load_tokenized(result)) == digest, case


def _square(x: int) -> int:
    return x * x


def test_map_chunks_keeps_the_order_and_raises_a_workers_error():
    assert list(map_chunks(_square, range(50), num_proc=2)) == [x * x for x in range(50)]
    with pytest.raises(TypeError):
        list(map_chunks(_square, [1, 2, "three", 4], num_proc=2))


def test_bad_rows_keep_their_lines_and_threshold_across_chunks(tmp_path, model_dirs):
    good = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]}
    lines = [json.dumps(good).encode()] * 30
    lines[4], lines[17], lines[28] = b'{"messages": [', json.dumps({"messages": []}).encode(), b"\xff"
    path = tmp_path / "chat.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    results = [tokenize_dataset(path, model_dirs["text"], max_length=64, max_bad_fraction=0.2, num_proc=procs,
                                chunk_rows=4) for procs in (1, 2)]
    for result in results:
        assert [(bad.line, bad.reason[:12]) for bad in result.bad] == [
            (5, "invalid JSON"), (18, "'messages' i"), (29, "not UTF-8 te")]
        assert result.num_rows == 27
    with pytest.raises(DatasetError, match=r"(?s)3 of 30 rows are bad .*chat.jsonl:5: invalid JSON"):
        tokenize_dataset(path, model_dirs["text"], max_length=32, max_bad_fraction=0.05, num_proc=2, chunk_rows=4)


def test_rows_are_opened_without_reading_them(tmp_path, model_dirs):
    path = BUNDLED / "self_cognition" / "train.jsonl"
    result = tokenize_dataset(path, model_dirs["text"], max_length=512)
    allocated = pa.total_allocated_bytes()
    rows = load_tokenized(result)
    lengths = rows.lengths()
    assert pa.total_allocated_bytes() == allocated  # memory-mapped: opening and the lengths allocate nothing
    everything = list(rows)
    assert len(rows) == len(everything) == 210 and rows.meta["num_sequences"] == 210
    assert lengths.tolist() == [len(row["input_ids"]) for row in everything]
    assert rows[-1] == everything[-1] and rows[3:6] == everything[3:6] and rows[::50] == everything[::50]
    with pytest.raises(IndexError):
        rows[210]


class _CountingRows(list):
    def __init__(self, rows):
        super().__init__(rows)
        self.read = set()

    def __getitem__(self, index):
        self.read.add(index)
        return super().__getitem__(index)


def test_each_rank_reads_only_its_own_rows():
    rows = [{"input_ids": [i], "labels": [i]} for i in range(10)]
    seen = {}
    for rank in (0, 1):
        counting = _CountingRows(rows)
        batches = local_micro_batches(counting, batch_size=4, seed=3, rank=rank, world=2)
        seen[rank] = [[row["input_ids"][0] for row in next(batches)] for _ in range(3)]  # an epoch: 4 + 4 + 2
        assert counting.read == {i for batch in seen[rank] for i in batch}
    assert sorted(i for rank in seen for batch in seen[rank] for i in batch) == list(range(10))


@pytest.mark.parametrize("name,kind", [("self_cognition", "chat"), ("preference", "preference"),
                                       ("arithmetic", "prompts"), ("retrieval", "pairs")])
def test_a_streamed_file_encodes_as_the_file_does(name, kind, tmp_path, model_dirs, monkeypatch):
    """Every flow's row kind (sft chat, dpo preference, grpo prompts, embedding pairs) streams."""
    import pyarrow.parquet as pq

    from twinkle_core.hub import HubError
    from twinkle_core.hub.streaming import open_stream

    rows = [json.loads(line) for line in (BUNDLED / name / "train.jsonl").read_text().splitlines()]
    path = tmp_path / "rows.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    stream = open_stream(str(path))
    streamed = tokenize_dataset(stream, model_dirs["text"], kind=kind, max_length=512, num_proc=2, chunk_rows=50)
    monkeypatch.setenv("TWINKLE_CACHE", str(tmp_path / "another-cache"))  # encode again, not a cache hit
    from_file = tokenize_dataset(path, model_dirs["text"], kind=kind, max_length=512)
    assert from_file.path != streamed.path and streamed.content_hash == from_file.content_hash  # the same rows, the same cache entry
    assert list(load_tokenized(streamed)) == list(load_tokenized(from_file))
    assert _digest(load_tokenized(streamed)) == BEFORE[f"{name}/train/{kind}/False/512"][0]
    with pytest.raises(HubError, match="streaming reads a hub split or one local"):
        open_stream(str(tmp_path))
