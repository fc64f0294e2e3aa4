"""hf:// models and datasets resolved offline, for real, from a Hugging Face hub cache laid out in tmp."""
from __future__ import annotations

import pandas as pd
import pytest
from hub_builders import populate_hf_cache
from transformers import AutoModelForCausalLM, AutoTokenizer

from twinkle_core.hashing import hash_file
from twinkle_core.hub import HubError, resolve_dataset, resolve_model

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def test_hf_model_offline_from_cache(isolated_caches, tiny_model_files):
    snapshot = populate_hf_cache(isolated_caches["hf_hub"], "twinkle-org/tiny-llama", tiny_model_files, commit=COMMIT)
    resolved = resolve_model("hf://twinkle-org/tiny-llama")
    assert resolved.path == snapshot
    assert resolved.model_id == "hf://twinkle-org/tiny-llama"
    model = AutoModelForCausalLM.from_pretrained(resolved.path)
    assert model.config.model_type == "llama"
    assert AutoTokenizer.from_pretrained(resolved.path).chat_template
    by_branch = resolve_model("hf://twinkle-org/tiny-llama@main")
    by_commit = resolve_model(f"hf://twinkle-org/tiny-llama@{COMMIT}")
    assert by_branch.path == by_commit.path == snapshot
    assert by_branch.content_hash == by_commit.content_hash == resolved.content_hash


def test_hf_model_not_cached_names_id_and_cache(isolated_caches):
    with pytest.raises(HubError) as info:
        resolve_model("hf://twinkle-org/absent")
    message = str(info.value)
    assert "hf://twinkle-org/absent" in message
    assert str(isolated_caches["hf_hub"]) in message
    assert "hf download twinkle-org/absent" in message
    assert "offline mode is on" in message


def test_hf_unknown_revision_offline(isolated_caches, tiny_model_files):
    populate_hf_cache(isolated_caches["hf_hub"], "twinkle-org/tiny-llama", tiny_model_files, commit=COMMIT)
    with pytest.raises(HubError, match="--revision v9"):
        resolve_model("hf://twinkle-org/tiny-llama@v9")


def test_hf_dataset_offline_from_cache(isolated_caches, dataset_repo, chat_rows):
    populate_hf_cache(isolated_caches["hf_hub"], "twinkle-org/tiny-chat", dataset_repo, "dataset", COMMIT)
    train = resolve_dataset("hf://twinkle-org/tiny-chat")
    assert train.path.name == "data.parquet"
    assert train.path.is_relative_to(isolated_caches["twinkle"] / "datasets")
    assert train.content_hash == hash_file(train.path)
    rows = pd.read_parquet(train.path).to_dict("records")
    assert len(rows) == 4
    assert [m["content"] for m in rows[0]["messages"]] == [m["content"] for m in chat_rows[0]["messages"]]
    mtime = train.path.stat().st_mtime_ns
    again = resolve_dataset("hf://twinkle-org/tiny-chat@main:train")
    assert again.path == train.path and again.path.stat().st_mtime_ns == mtime  # written once, reused
    test = resolve_dataset(f"hf://twinkle-org/tiny-chat@{COMMIT}:test")
    assert test.path != train.path and len(pd.read_parquet(test.path)) == 2


def test_hf_dataset_errors(isolated_caches, dataset_repo):
    with pytest.raises(HubError, match="hf download --repo-type dataset twinkle-org/absent"):
        resolve_dataset("hf://twinkle-org/absent")
    populate_hf_cache(isolated_caches["hf_hub"], "twinkle-org/tiny-chat", dataset_repo, "dataset", COMMIT)
    with pytest.raises(HubError, match="could not load split 'validation'"):
        resolve_dataset("hf://twinkle-org/tiny-chat:validation")


@pytest.fixture
def unreachable_hub(monkeypatch):
    """Online mode against an endpoint where nothing listens (connection refused at once)."""
    import huggingface_hub.constants

    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "http://127.0.0.1:9")


def test_hf_model_online_but_unreachable_uses_cache(isolated_caches, tiny_model_files, unreachable_hub):
    snapshot = populate_hf_cache(isolated_caches["hf_hub"], "twinkle-org/tiny-llama", tiny_model_files, commit=COMMIT)
    assert resolve_model("hf://twinkle-org/tiny-llama").path == snapshot
    with pytest.raises(HubError, match="the hub could not be reached"):
        resolve_model("hf://twinkle-org/absent")



def test_hf_dataset_streams_offline_from_cache_without_a_copy(isolated_caches, dataset_repo, chat_rows):
    from twinkle_core.hub.streaming import open_stream

    populate_hf_cache(isolated_caches["hf_hub"], "twinkle-org/tiny-chat", dataset_repo, "dataset", COMMIT)
    stream = open_stream("hf://twinkle-org/tiny-chat")
    rows = list(stream.records())
    assert [number for number, _ in rows] == [1, 2, 3, 4]
    assert [m["content"] for m in rows[0][1]["messages"]] == [m["content"] for m in chat_rows[0]["messages"]]
    assert open_stream(f"hf://twinkle-org/tiny-chat@{COMMIT}").content_hash == stream.content_hash
    assert len(list(open_stream("hf://twinkle-org/tiny-chat:test").records())) == 2
    assert not (isolated_caches["twinkle"] / "datasets").exists()  # nothing materialised
