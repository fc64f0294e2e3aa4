"""ms:// models and datasets resolved offline, for real, by modelscope's own snapshot_download."""
from __future__ import annotations

import os

import pandas as pd
import pytest
from hub_builders import populate_ms_cache, write_jsonl
from transformers import AutoModelForCausalLM, AutoTokenizer

from twinkle_core.hub import HubError, resolve_dataset, resolve_model


def test_ms_model_offline_from_cache(isolated_caches, tiny_model_files):
    snapshot = populate_ms_cache(isolated_caches["ms"], "TwinkleOrg/Tiny-Llama-0.1B", tiny_model_files)
    resolved = resolve_model("ms://TwinkleOrg/Tiny-Llama-0.1B")
    assert resolved.path == snapshot
    AutoModelForCausalLM.from_pretrained(resolved.path)
    assert AutoTokenizer.from_pretrained(resolved.path).chat_template
    assert resolve_model("ms://TwinkleOrg/Tiny-Llama-0.1B@master").content_hash == resolved.content_hash


def test_ms_model_revision_and_hash_follows_files(isolated_caches, tiny_model_files):
    snapshot = populate_ms_cache(isolated_caches["ms"], "TwinkleOrg/tiny", tiny_model_files, revision="v1.0")
    first = resolve_model("ms://TwinkleOrg/tiny@v1.0")
    assert first.path == snapshot
    # a re-download rewrites files in the same 'v1.0' folder: the key must change with them
    config = snapshot / "config.json"
    stat = config.stat()
    os.utime(config, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert resolve_model("ms://TwinkleOrg/tiny@v1.0").content_hash != first.content_hash
    with pytest.raises(HubError, match="--revision v2.0"):
        resolve_model("ms://TwinkleOrg/tiny@v2.0")


def test_ms_model_not_cached_names_id_and_cache(isolated_caches):
    with pytest.raises(HubError) as info:
        resolve_model("ms://TwinkleOrg/absent")
    message = str(info.value)
    assert "ms://TwinkleOrg/absent" in message
    assert str(isolated_caches["ms"]) in message
    assert "modelscope download --model TwinkleOrg/absent" in message


def test_ms_offline_switch_of_its_own(isolated_caches, tiny_model_files, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setenv("MODELSCOPE_OFFLINE", "1")
    populate_ms_cache(isolated_caches["ms"], "TwinkleOrg/tiny", tiny_model_files)
    assert resolve_model("ms://TwinkleOrg/tiny").path.is_dir()


def test_ms_online_falls_back_to_cache_when_unreachable(isolated_caches, tiny_model_files, monkeypatch):
    import modelscope_hub._legacy_api

    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setenv("MODELSCOPE_ENDPOINT", "http://127.0.0.1:9")  # nothing listens: connection refused
    monkeypatch.setattr(modelscope_hub._legacy_api, "REPO_TREE_PAGE_MAX_ATTEMPTS", 1)  # no retry back-off
    snapshot = populate_ms_cache(isolated_caches["ms"], "TwinkleOrg/tiny", tiny_model_files)
    assert resolve_model("ms://TwinkleOrg/tiny").path == snapshot
    with pytest.raises(HubError, match="the hub could not be reached") as info:
        resolve_model("ms://TwinkleOrg/absent")
    assert "Connection" in str(info.value)


def test_ms_dataset_offline_from_cache(isolated_caches, dataset_repo, chat_rows):
    snapshot = populate_ms_cache(isolated_caches["ms"], "TwinkleOrg/tiny-chat", dataset_repo, "dataset")
    train = resolve_dataset("ms://TwinkleOrg/tiny-chat")
    assert len(pd.read_parquet(train.path)) == 4
    assert resolve_dataset("ms://TwinkleOrg/tiny-chat@master:train").path == train.path
    assert len(pd.read_parquet(resolve_dataset("ms://TwinkleOrg/tiny-chat:test").path)) == 2
    # new content under the same revision folder must not be served from the old cache entry
    write_jsonl(snapshot / "data" / "train.jsonl", chat_rows + chat_rows[:1])
    changed = resolve_dataset("ms://TwinkleOrg/tiny-chat")
    assert changed.path != train.path and len(pd.read_parquet(changed.path)) == 7


def test_ms_dataset_not_cached(isolated_caches):
    with pytest.raises(HubError, match="modelscope download --dataset TwinkleOrg/absent"):
        resolve_dataset("ms://TwinkleOrg/absent")
