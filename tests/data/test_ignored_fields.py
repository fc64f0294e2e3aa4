"""Row fields that training ignores: one warning per dataset, with counts, kept in the cache entry."""
from __future__ import annotations

import json
import logging

import pytest
from test_chat_templates import FAMILY_TOKENIZERS, TOOLS
from tiny_models import make_tiny_tokenizer

from twinkle_core.data import read_meta, tokenize_dataset
from twinkle_core.data.rows import IgnoredFields

CHAT = {"messages": [{"role": "user", "content": "Who are you?"}, {"role": "assistant", "content": "I am Twinkle."}]}


@pytest.fixture
def tokenizer_dir(tmp_path, tokenizer):
    tokenizer.save_pretrained(tmp_path / "tokenizer")  # its template renders no tools
    return tmp_path / "tokenizer"


def _write(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _warnings(caplog, text):
    return [record.getMessage() for record in caplog.records
            if record.levelno == logging.WARNING and text in record.getMessage()]


def test_chat_rows_warn_once_of_the_fields_they_ignore(tmp_path, tokenizer_dir, caplog):
    rows = [{**CHAT, "rejected": "No."}, {**CHAT, "rejected": "No."}, {**CHAT, "rejected": "No.", "id": 7},
            {**CHAT, "source": None, "tools": []}]  # null and empty fields hold nothing to lose
    path = _write(tmp_path / "rows.jsonl", rows)
    expected = (f"{path}: 3 of 4 rows carry fields the chat rows do not use, ignored: 'rejected' (3 rows: "
                "preference pairs train with the dpo flow), 'id' (1 row)")
    with caplog.at_level(logging.INFO, logger="twinkle_core.data"):
        first = tokenize_dataset(path, tokenizer_dir, max_length=64, num_proc=2, chunk_rows=2)  # summed over chunks
    assert first.num_rows == 4 and first.num_bad == 0
    assert first.ignored == IgnoredFields("chat", rows_read=4, rows=3, keys=(("rejected", 3), ("id", 1)))
    assert _warnings(caplog, "do not use") == [expected]
    assert _warnings(caplog, "'tools'") == []
    meta = json.loads((first.path / "meta.json").read_text())
    assert (meta["ignored_fields"], meta["ignored_field_rows"]) == ({"rejected": 3, "id": 1}, 3)

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="twinkle_core.data"):
        again = tokenize_dataset(path, tokenizer_dir, max_length=64)
    assert "reusing tokenised data" in caplog.text
    assert again == first
    assert _warnings(caplog, "do not use") == [expected]


def test_an_entry_written_before_the_counts_reads_as_nothing_ignored(tmp_path, tokenizer_dir):
    path = _write(tmp_path / "rows.jsonl", [{**CHAT, "id": 1}])
    entry = tokenize_dataset(path, tokenizer_dir, max_length=64).path
    meta = json.loads((entry / "meta.json").read_text())
    for key in ("ignored_fields", "ignored_field_rows", "untrained_tools_rows"):
        del meta[key]
    (entry / "meta.json").write_text(json.dumps(meta))
    assert read_meta(entry).ignored == IgnoredFields("chat", rows_read=1)
    assert read_meta(entry).ignored.warnings("rows.jsonl") == []


def test_tools_the_template_does_not_render_are_warned_of(tmp_path, tokenizer_dir, caplog):
    path = _write(tmp_path / "tools.jsonl", [{**CHAT, "tools": TOOLS}, {**CHAT, "tools": TOOLS}, CHAT])
    with caplog.at_level(logging.WARNING, logger="twinkle_core.data"):
        result = tokenize_dataset(path, tokenizer_dir, max_length=256)
    assert result.num_rows == 3
    assert result.ignored == IgnoredFields("chat", rows_read=3, tools_rows=2)
    assert _warnings(caplog, "'tools'") == [
        f"{path}: 2 of 3 rows carry 'tools', but the chat template of this model renders no tool schemas: they train "
        "without them"]
    assert _warnings(caplog, "do not use") == []


def test_tools_the_template_renders_are_not_warned_of(tmp_path, caplog):
    make_tiny_tokenizer(chat_template=None, **FAMILY_TOKENIZERS["qwen3_5"]).save_pretrained(tmp_path / "qwen")
    path = _write(tmp_path / "tools.jsonl", [{**CHAT, "tools": TOOLS}, CHAT])
    with caplog.at_level(logging.WARNING, logger="twinkle_core.data"):
        result = tokenize_dataset(path, tmp_path / "qwen", max_length=4096, chat_template="qwen3_5")
    assert result.num_rows == 2
    assert result.ignored == IgnoredFields("chat", rows_read=2)
    assert _warnings(caplog, "'tools'") == []


def test_rows_that_use_every_field_are_not_warned_of(tmp_path, tokenizer_dir, caplog):
    prompt = CHAT["messages"][:1]
    reference = {"ref_chosen_logps": -1.0, "ref_rejected_logps": -2.0}
    preference = [  # every layout the preference kind accepts, with reference log-probs
        {"messages": prompt, "chosen": "I am Twinkle.", "rejected": "No.", **reference},
        {"prompt": "Who are you?", "chosen": [{"role": "assistant", "content": "Twinkle."}], "rejected": "No.",
         **reference},
        {"messages": CHAT["messages"], "rejected_response": "No.", **reference},
    ]
    pairs = [  # and the embedding pairs' layouts
        {"query": "Who?", "positive": "Twinkle.", "negatives": ["Paris."]},
        {"anchor": "Who?", "positives": ["Twinkle."], "negative": "Paris."},
        {"messages": [{"role": "user", "content": "Who?"}], "positive_messages": [[{"role": "user", "content": "Me."}]],
         "negative_messages": [[{"role": "user", "content": "Paris."}]]},
    ]
    prompts = [{"prompt": "What is 3 + 4?", "solution": "7", "id": 1}]  # the reward functions read the others
    with caplog.at_level(logging.WARNING, logger="twinkle_core.data"):
        results = [tokenize_dataset(_write(tmp_path / f"{kind}.jsonl", rows), tokenizer_dir, kind=kind, max_length=64)
                   for kind, rows in (("preference", preference), ("pairs", pairs), ("prompts", prompts))]
    assert [result.num_rows for result in results] == [3, 3, 1]
    assert [result.ignored.warnings("x") for result in results] == [[], [], []]
    assert _warnings(caplog, "do not use") == []


def test_other_kinds_name_their_own_rows_and_hint_only_where_a_flow_fits(tmp_path, tokenizer_dir, caplog):
    path = _write(tmp_path / "text.jsonl", [{"text": "Hello there.", "url": "u"}, {"text": "Paris.", "solution": "7"}])
    with caplog.at_level(logging.WARNING, logger="twinkle_core.data"):
        result = tokenize_dataset(path, tokenizer_dir, kind="text", max_length=64)
    assert result.num_rows == 2
    assert _warnings(caplog, "do not use") == [
        f"{path}: 2 of 2 rows carry fields the text rows do not use, ignored: 'solution' (1 row: prompts and their "
        "reward fields train with the grpo flow), 'url' (1 row)"]


@pytest.mark.parametrize("chunk_rows", [4, 1])  # within one chunk, and across chunks
def test_reference_logps_on_some_rows_only_are_refused_by_name(tmp_path, tokenizer_dir, chunk_rows):
    from twinkle_core.data import DatasetError

    pair = {"messages": CHAT["messages"][:1], "chosen": "I am Twinkle.", "rejected": "No."}
    rows = [{**pair, "ref_chosen_logps": -1.0, "ref_rejected_logps": -2.0}, pair]
    path = _write(tmp_path / "pairs.jsonl", rows)
    with pytest.raises(DatasetError, match=r"the rows differ in their fields: \['ref_chosen_logps', "
                                           r"'ref_rejected_logps'\] on some rows and not on others"):
        tokenize_dataset(path, tokenizer_dir, kind="preference", max_length=64, num_proc=1, chunk_rows=chunk_rows)
