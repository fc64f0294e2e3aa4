"""Chat rows with tools, tool calls and reasoning: validation, loading and the tokenised-data cache."""
from __future__ import annotations

import json

import pytest
from test_chat_templates import CALL, FAMILY_TOKENIZERS, TOOLS, family_tokenizer
from tiny_models import make_tiny_tokenizer

from twinkle_core.data import RowError, encode_chat, load_rows, load_tokenized, tokenize_dataset, validate_chat_row

TOOL_ROW = {
    "tools": TOOLS,
    "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "reasoning_content": "Look it up.", "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call00001", "name": "get_weather", "content": "sunny"},
        {"role": "assistant", "content": "<think>Report it.</think>Sunny."},
    ],
}


def test_tool_rows_are_kept_with_arguments_parsed():
    row = validate_chat_row(TOOL_ROW)
    assert row["tools"] == TOOLS
    call = row["messages"][1]["tool_calls"][0]
    assert call["function"]["arguments"] == {"city": "Paris"} and call["id"] == "call00001"
    assert "content" not in row["messages"][1]  # null fields are dropped; the call alone is the reply
    assert validate_chat_row({**TOOL_ROW, "tools": None}).keys() == {"messages"}
    only_a_call = {"messages": TOOL_ROW["messages"][:2]}
    assert validate_chat_row(only_a_call)["messages"][1]["tool_calls"][0]["function"]["name"] == "get_weather"


def _with_message(index, **changes):
    messages = [dict(message) for message in TOOL_ROW["messages"]]
    messages[index].update(changes)
    return {**TOOL_ROW, "messages": messages}


@pytest.mark.parametrize(("row", "reason"), [
    ({**TOOL_ROW, "tools": {"name": "get_weather"}}, "'tools' is an object, expected a list of tool schemas"),
    ({**TOOL_ROW, "tools": [{"name": "get_weather"}]}, "tools[0] is an object without a named 'function'"),
    (_with_message(1, tool_calls={"name": "x"}), "messages[1].tool_calls is an object, expected a non-empty list"),
    (_with_message(1, tool_calls=[{"name": "x"}]), "messages[1].tool_calls[0] is an object without a 'function'"),
    (_with_message(1, tool_calls=[{"function": {"arguments": "{}"}}]),
     "messages[1].tool_calls[0].function.name is null, expected the tool's name"),
    (_with_message(1, tool_calls=[{"function": {"name": "x", "arguments": "{city"}}]),
     "messages[1].tool_calls[0].function.arguments is not valid JSON"),
    (_with_message(1, tool_calls=[{"function": {"name": "x", "arguments": "[1]"}}]),
     "messages[1].tool_calls[0].function.arguments is '[1]', expected an object"),
    (_with_message(1, tool_calls=[{"type": "code", "function": {"name": "x"}}]),
     "messages[1].tool_calls[0].type is 'code'; only function calls are supported"),
    (_with_message(1, reasoning_content=["a"]), "messages[1].reasoning_content is a list, expected a string"),
    (_with_message(2, tool_call_id=7), "messages[2].tool_call_id is a number, expected a string"),
    (_with_message(0, tool_calls=[CALL]), "messages[0].tool_calls must be a list on an assistant message"),
])
def test_malformed_tool_rows_name_the_field(row, reason):
    with pytest.raises(RowError) as error:
        validate_chat_row(row)
    assert str(error.value).startswith(reason)


@pytest.fixture
def qwen_dir(tmp_path):
    """A Qwen 3.5 tokenizer directory, saved without a chat template as base checkpoints are."""
    tokenizer = make_tiny_tokenizer(chat_template=None, **FAMILY_TOKENIZERS["qwen3_5"])
    tokenizer.save_pretrained(tmp_path / "qwen")
    return tmp_path / "qwen"


def test_tokenized_tool_rows_match_direct_encoding(tmp_path, qwen_dir):
    path = tmp_path / "tools.jsonl"
    path.write_text(json.dumps(TOOL_ROW) + "\n")
    assert load_rows(path).rows[0]["tools"] == TOOLS
    thinking = tokenize_dataset(path, qwen_dir, max_length=4096, chat_template="qwen3_5")
    plain = tokenize_dataset(path, qwen_dir, max_length=4096, chat_template="qwen3_5", enable_thinking=False)
    qwen = family_tokenizer("qwen3_5")
    assert list(load_tokenized(thinking)) == [encode_chat(qwen, TOOL_ROW["messages"], tools=TOOLS)]
    assert list(load_tokenized(plain)) == [encode_chat(qwen, TOOL_ROW["messages"], tools=TOOLS, enable_thinking=False)]
    assert plain.content_hash != thinking.content_hash
    assert plain.num_trained_tokens < thinking.num_trained_tokens  # the reasoning is no longer trained


def test_rows_the_template_cannot_render_are_reported_as_bad(tmp_path):
    tokenizer_dir = tmp_path / "mistral"
    family_tokenizer("mistral").save_pretrained(tokenizer_dir)
    path = tmp_path / "tools.jsonl"
    no_id = {key: value for key, value in CALL.items() if key != "id"}
    rows = [TOOL_ROW, {**TOOL_ROW, "messages": [TOOL_ROW["messages"][0], {"role": "assistant", "tool_calls": [no_id]}]}]
    path.write_text("\n".join(json.dumps(row) for row in rows) + "\n")
    result = tokenize_dataset(path, tokenizer_dir, max_length=512, max_bad_fraction=0.5)
    assert (result.num_examples, result.num_bad) == (1, 1)
    assert result.bad[0].line == 2
    assert "Tool call IDs should be alphanumeric strings with length 9" in result.bad[0].reason
