"""The tokenised-data cache: contents, reuse, invalidation, packing and truncation."""
from __future__ import annotations

import json
import logging

import pytest

import twinkle_core.data.tokenized as tokenized
from twinkle_core.data import DatasetError, encode_chat, load_tokenized, tokenize_dataset


def _chat(question, answer):
    return {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]}


ROWS = [
    _chat("Who are you?", "I am Twinkle."),
    _chat("What is the capital of France?", "Paris."),
    _chat("What is your name?", "Twinkle, built by the Twinkle Flows team."),
]


@pytest.fixture
def tokenizer_dir(tmp_path, tokenizer):
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    return tmp_path / "tokenizer"


@pytest.fixture
def dataset(tmp_path):
    path = tmp_path / "chat.jsonl"
    path.write_text("\n".join(json.dumps(row) for row in ROWS) + '\n{"messages": []}\n')
    return path


def test_tokenized_rows_match_direct_encoding(dataset, tokenizer_dir, tokenizer, private_cache):
    result = tokenize_dataset(dataset, tokenizer_dir, max_length=64, max_bad_fraction=0.5)
    assert result.path.parent == private_cache / "tokenized"
    assert result.path.name == result.content_hash[:16]
    expected = [encode_chat(tokenizer, row["messages"]) for row in ROWS]
    assert list(load_tokenized(result)) == expected
    assert (result.num_rows, result.num_examples, result.num_bad) == (3, 3, 1)
    assert result.num_tokens == sum(len(e["input_ids"]) for e in expected)
    assert result.num_trained_tokens == sum(sum(label != -100 for label in e["labels"]) for e in expected)
    assert [(bad.file, bad.line, bad.reason) for bad in result.bad] == [(str(dataset), 4, "'messages' is empty")]
    meta = json.loads((result.path / "meta.json").read_text())
    assert meta["bad"] == [{"file": str(dataset), "line": 4, "reason": "'messages' is empty"}]


def test_second_call_reuses_and_an_edit_invalidates(dataset, tokenizer_dir, monkeypatch, caplog):
    first = tokenize_dataset(dataset, tokenizer_dir, max_length=64, max_bad_fraction=0.5)
    mtime = (first.path / "data.arrow").stat().st_mtime_ns

    def must_not_reload(*args, **kwargs):
        raise AssertionError("the cached entry should have been reused")

    with monkeypatch.context() as patch, caplog.at_level(logging.INFO, logger="twinkle_core.data"):
        patch.setattr(tokenized, "read_record_chunks", must_not_reload)
        again = tokenize_dataset(dataset, tokenizer_dir, max_length=64, max_bad_fraction=0.5)
    assert again == first
    assert (first.path / "data.arrow").stat().st_mtime_ns == mtime
    assert "reusing tokenised data" in caplog.text
    # The cached entry still honours a stricter threshold.
    with pytest.raises(DatasetError, match="max_bad_fraction=0.1"):
        tokenize_dataset(dataset, tokenizer_dir, max_length=64, max_bad_fraction=0.1)
    assert tokenize_dataset(dataset, tokenizer_dir, max_length=32, max_bad_fraction=0.5).path != first.path
    dataset.write_text(dataset.read_text().replace("Paris.", "Paris, France."))
    edited = tokenize_dataset(dataset, tokenizer_dir, max_length=64, max_bad_fraction=0.5)
    assert edited.content_hash != first.content_hash and edited.path != first.path
    assert edited.num_trained_tokens > first.num_trained_tokens


def test_packed_cache_holds_position_ids(dataset, tokenizer_dir):
    plain = tokenize_dataset(dataset, tokenizer_dir, max_length=64, max_bad_fraction=0.5)
    packed = tokenize_dataset(dataset, tokenizer_dir, max_length=64, packing=True, max_bad_fraction=0.5)
    rows = load_tokenized(packed.path)
    assert packed.content_hash != plain.content_hash
    assert (packed.num_examples, packed.num_tokens) == (3, plain.num_tokens)
    assert packed.num_rows == len(rows) < 3
    assert all(len(row["position_ids"]) == len(row["input_ids"]) <= 64 for row in rows)
    assert sum(row["position_ids"].count(0) for row in rows) == 3
    assert packed.num_trained_tokens == plain.num_trained_tokens  # chat rows never train their first token


def test_rows_whose_reply_is_cut_off_are_bad(tmp_path, tokenizer_dir):
    path = tmp_path / "long.jsonl"
    long_prompt = _chat("Who are you? " * 20, "I am Twinkle.")
    path.write_text("\n".join(json.dumps(row) for row in [*ROWS, long_prompt]) + "\n")
    result = tokenize_dataset(path, tokenizer_dir, max_length=28, max_bad_fraction=0.3)
    assert result.num_examples == 3
    assert [(bad.line, bad.reason.split(":")[0]) for bad in result.bad] == [
        (4, "no trained token within max_length=28")
    ]
    assert [len(row["input_ids"]) for row in load_tokenized(result)] == [23, 28, 28]  # longer rows were cut
    with pytest.raises(DatasetError, match="1 of 4 rows are bad"):
        tokenize_dataset(path, tokenizer_dir, max_length=28, max_bad_fraction=0.1)


def test_text_rows(tmp_path, tokenizer_dir, tokenizer):
    path = tmp_path / "text.jsonl"
    path.write_text('{"text": "The capital of France is Paris."}\n')
    rows = load_tokenized(tokenize_dataset(path, tokenizer_dir, kind="text", max_length=64))
    assert tokenizer.decode(rows[0]["input_ids"]) == "The capital of France is Paris.<|im_end|>"
    assert rows[0]["labels"] == rows[0]["input_ids"]
