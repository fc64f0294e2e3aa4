"""Row loading: formats, validation reasons with file:line, and the bad-row threshold."""
from __future__ import annotations

import json
import logging

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from twinkle_core.data import DatasetError, RowFormat, load_rows, register_row_format

GOOD = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]}
BAD_LINES = [
    ("{not json", "invalid JSON"),
    ("[1, 2]", "row is a list, expected a JSON object"),
    ('{"text": "hi"}', "missing 'messages'"),
    ('{"messages": "hi"}', "'messages' is a string, expected a list"),
    ('{"messages": []}', "'messages' is empty"),
    ('{"messages": [{"role": "bot", "content": "x"}]}', "messages[0].role is 'bot', expected one of"),
    ('{"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "x"}]}',
     "messages[0].content is a number, expected a string"),
    ('{"messages": [{"role": "user", "content": "Hi"}]}', "no assistant turn with content"),
    ('{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": " "}]}',
     "messages[1] is an assistant turn with empty or non-string content"),
    ('{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant"}]}',
     "messages[1] is an assistant turn with empty or non-string content (null)"),
]


def _write_jsonl(path, good_rows, bad_lines):
    """One bad line after every 10th good row while they last; returns {line number: expected reason}."""
    lines, expected = [], {}
    for index in range(good_rows):
        lines.append(json.dumps(GOOD))
        slot = index // 10
        if index % 10 == 9 and slot < len(bad_lines):
            text, reason = bad_lines[slot]
            lines.append(text)
            expected[len(lines)] = reason
    path.write_text("\n".join(lines) + "\n\n")  # a trailing blank line is not a row
    return expected


def test_bad_rows_are_reported_with_file_line_and_reason(tmp_path, caplog):
    path = tmp_path / "chat.jsonl"
    expected = _write_jsonl(path, 100, BAD_LINES)
    with caplog.at_level(logging.WARNING):
        loaded = load_rows(path, "chat", max_bad_fraction=0.1)
    assert len(loaded.rows) == 100 and loaded.rows[0] == GOOD
    assert [(bad.file, bad.line) for bad in loaded.bad] == [(str(path), line) for line in expected]
    for bad in loaded.bad:
        assert bad.reason.startswith(expected[bad.line]), (bad, expected[bad.line])
    assert loaded.lines[:11] == list(range(1, 11)) + [12]
    assert "skipping 10 bad rows of 110" in caplog.text
    assert f"{path}:11: invalid JSON" in caplog.text


def test_too_many_bad_rows_raise_naming_the_option(tmp_path):
    path = tmp_path / "chat.jsonl"
    _write_jsonl(path, 100, BAD_LINES[:3])
    with pytest.raises(DatasetError, match="max_bad_fraction") as error:
        load_rows(path, "chat", max_bad_fraction=0.01)
    assert "3 of 103 rows are bad" in str(error.value)
    assert f"{path}:11: invalid JSON" in str(error.value)
    assert len(load_rows(path, "chat", max_bad_fraction=0.03).bad) == 3


def test_no_good_row_always_raises(tmp_path):
    path = tmp_path / "chat.jsonl"
    path.write_text("\n".join(text for text, _ in BAD_LINES + BAD_LINES[:2]) + "\n")
    with pytest.raises(DatasetError, match="none of its 12 rows is usable") as error:
        load_rows(path, "chat", max_bad_fraction=1.0)
    assert str(error.value).endswith(f"{path}:10: messages[1] is an assistant turn with empty or non-string "
                                     "content (null)\n  ... and 2 more")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(DatasetError, match="has no rows"):
        load_rows(empty, "chat", max_bad_fraction=1.0)


def test_json_list_rows_are_numbered_from_one(tmp_path):
    path = tmp_path / "chat.json"
    path.write_text(json.dumps([GOOD, {"messages": []}, GOOD]))
    loaded = load_rows(path, "chat", max_bad_fraction=0.5)
    assert loaded.rows == [GOOD, GOOD] and loaded.lines == [1, 3]
    assert [(bad.line, bad.reason) for bad in loaded.bad] == [(2, "'messages' is empty")]
    path.write_text(json.dumps(GOOD))
    with pytest.raises(DatasetError, match="must be a list of row objects"):
        load_rows(path, "chat")


def test_parquet_rows_drop_null_struct_fields(tmp_path):
    tool_call = [{"type": "function", "function": {"name": "lookup", "arguments": "{}"}}]
    rows = [
        GOOD,
        {"messages": [
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": None, "tool_calls": tool_call},
            {"role": "tool", "content": "sunny"},
            {"role": "assistant", "content": "Sunny."},
        ]},
    ]
    path = tmp_path / "chat.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    loaded = load_rows(path, "chat")
    assert loaded.bad == [] and loaded.lines == [1, 2]
    assert loaded.rows[0] == GOOD  # no "tool_calls": None filled in by the parquet struct
    # JSON-string arguments (the only form parquet can hold for free-form objects) are parsed for the templates.
    parsed_call = [{"type": "function", "function": {"name": "lookup", "arguments": {}}}]
    assert loaded.rows[1]["messages"][1] == {"role": "assistant", "tool_calls": parsed_call}


def test_text_rows_and_unknown_inputs(tmp_path):
    path = tmp_path / "text.jsonl"
    path.write_text('{"text": "Paris is in France."}\n{"text": ""}\n{"body": "x"}\n')
    loaded = load_rows(path, "text", max_bad_fraction=1.0)
    assert loaded.rows == [{"text": "Paris is in France."}]
    assert [bad.reason for bad in loaded.bad] == ["'text' is empty", "missing 'text'"]
    with pytest.raises(ValueError, match="kind='kto' is not a known row kind; use one of: chat, pairs, preference, prompts, text"):
        load_rows(path, "kto")
    with pytest.raises(DatasetError, match="suffix '.csv'"):
        (tmp_path / "rows.csv").write_text("a,b\n")
        load_rows(tmp_path / "rows.csv", "text")


def test_row_kinds_cannot_be_registered_twice():
    with pytest.raises(ValueError, match="'chat' is already registered"):
        register_row_format(RowFormat("chat", dict, lambda tokenizer, row: row))


def test_a_line_that_is_not_utf8_is_one_bad_row_named_by_line(tmp_path):
    path = tmp_path / "chat.jsonl"
    good = json.dumps(GOOD).encode()
    path.write_bytes(b"\n".join([good, good.replace(b"Hello", b"H\xe9llo"), good]) + b"\n")  # latin-1 é
    loaded = load_rows(path, "chat", max_bad_fraction=0.5)
    assert len(loaded.rows) == 2 and loaded.lines == [1, 3]
    assert [(bad.line, bad.reason) for bad in loaded.bad] == [(2, "not UTF-8 text (byte 85 of the line is 0xe9)")]
    whole = tmp_path / "chat.json"
    whole.write_bytes(b"[\n" + good + b",\n" + good.replace(b"Hello", b"H\xe9llo") + b"\n]")
    with pytest.raises(DatasetError, match=r"chat.json is not UTF-8 text: byte 0xe9 on line 3"):
        load_rows(whole, "chat", max_bad_fraction=0.5)


def test_chat_rows_with_media_are_refused_for_a_text_model():
    from twinkle_core.data import RowError
    from twinkle_core.data.formats import get_row_format

    text = get_row_format("chat")
    plain = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    assert text.check(plain)["messages"][1]["content"] == "hello"
    for row, what in (({**plain, "images": ["a.png"]}, "images"), ({**plain, "videos": ["a.mp4"]}, "videos"),
                      ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "a"}},
                                                                 {"type": "text", "text": "?"}]},
                                     {"role": "assistant", "content": "ok"}]}, "image_url")):
        with pytest.raises(RowError, match=f"the row carries {what}, but this run's model reads text only"):
            text.check(row)
