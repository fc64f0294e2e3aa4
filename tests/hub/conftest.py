"""Fixtures for the hub tests: every cache in tmp, offline mode on (no hub is reachable from the tests)."""
from __future__ import annotations

import shutil

import pytest
from hub_builders import write_jsonl, write_tiny_gguf
from tiny_models import make_tiny_causal_lm

_OFFLINE_VARS = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE", "MODELSCOPE_OFFLINE")


@pytest.fixture(autouse=True)
def isolated_caches(tmp_path, monkeypatch):
    """Point TWINKLE_CACHE, the HF and ModelScope caches at tmp and switch offline mode on."""
    import datasets.config
    import huggingface_hub.constants
    import modelscope_hub.config

    caches = {
        "twinkle": tmp_path / "twinkle_cache",
        "hf_home": tmp_path / "hf_home",
        "hf_hub": tmp_path / "hf_home" / "hub",
        "ms": tmp_path / "ms_cache",
        "ms_home": tmp_path / "ms_home",
    }
    monkeypatch.setenv("TWINKLE_CACHE", str(caches["twinkle"]))
    monkeypatch.setenv("HF_HOME", str(caches["hf_home"]))
    monkeypatch.setenv("HF_HUB_CACHE", str(caches["hf_hub"]))
    monkeypatch.setenv("MODELSCOPE_CACHE", str(caches["ms"]))
    monkeypatch.setenv("MODELSCOPE_HOME", str(caches["ms_home"]))  # modelscope writes its config dir here
    for var in _OFFLINE_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # huggingface_hub and datasets read these at import time: patch them so nothing tries the network.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(caches["hf_hub"]))
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    # modelscope builds its config (endpoint, cache, config dir) from the environment once per process.
    monkeypatch.setattr(modelscope_hub.config, "_default_config", None)
    return caches


@pytest.fixture(scope="session")
def tiny_model_files(tmp_path_factory):
    """A tiny Llama HF directory (config, safetensors, tokenizer with chat template), built once."""
    from tiny_models import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("tiny_model"))


@pytest.fixture
def tiny_model_dir(tiny_model_files, tmp_path):
    """A private copy of the tiny model directory that a test may edit."""
    return shutil.copytree(tiny_model_files, tmp_path / "tiny_model")


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory):
    """(path to a tiny F32 Llama GGUF, the model it was written from, its tokenizer)."""
    model, tokenizer = make_tiny_causal_lm("llama")
    path = write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", model, tokenizer)
    return path, model, tokenizer


@pytest.fixture
def chat_rows():
    return [
        {"messages": [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": f"answer {i}"}]}
        for i in range(6)
    ]


@pytest.fixture
def dataset_repo(tmp_path, chat_rows):
    """A dataset repo folder as on a hub: README plus data/train.jsonl and data/test.jsonl."""
    repo = tmp_path / "dataset_repo"
    write_jsonl(repo / "data" / "train.jsonl", chat_rows[:4])
    write_jsonl(repo / "data" / "test.jsonl", chat_rows[4:])
    (repo / "README.md").write_text("# tiny chat dataset\n")
    return repo
