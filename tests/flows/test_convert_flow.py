"""The convert flow under a real Prefect API: HF → Megatron (tp=2, torchrun) → HF, cached, and its refusals."""
from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from family_models import save_tiny_family_model
from flows.convert import ConvertConfig, convert_checkpoint, main
from twinkle_core.convert import NotMegatronCapableError


@pytest.fixture
def convert_workspace(tmp_path, monkeypatch, prefect_harness):
    monkeypatch.setenv("TWINKLE_CACHE", str(tmp_path / "cache"))
    return tmp_path


def test_hf_to_megatron_and_back_is_exact_and_cached(convert_workspace, capsys):
    root = convert_workspace
    source = save_tiny_family_model("qwen2_5", root / "qwen2_5")  # 2 key/value heads: tp=2 splits them
    assert main(["--model-id", str(source), "--to", "megatron", "--tp", "2", "--output", str(root / "mcore")]) == 0
    assert capsys.readouterr().out.strip().endswith(str(root / "mcore"))
    for part in ("twinkle_megatron.json", "megatron/metadata.json", "hf/config.json", "hf/tokenizer.json"):
        assert (root / "mcore" / part).is_file(), part

    again = convert_checkpoint(ConvertConfig(model_id=str(source), to="megatron", tp=2))
    cached = next((root / "cache" / "conversions").glob("megatron-qwen2_5-tp2pp1-*"))
    assert again["cached"] == str(cached) and again["family"] == "qwen2_5"
    assert len(list((root / "cache" / "conversions").iterdir())) == 1  # converted once

    back = convert_checkpoint(ConvertConfig(model_id=str(root / "mcore"), to="hf", output=str(root / "hf")))
    assert back["path"] == str(root / "hf")
    original, exported = load_file(source / "model.safetensors"), load_file(root / "hf" / "model.safetensors")
    assert sorted(exported) == sorted(original)
    assert all(torch.equal(exported[name], tensor) for name, tensor in original.items())
    model = AutoModelForCausalLM.from_pretrained(root / "hf")
    assert model.config.model_type == "qwen2"


def test_refusals_name_the_option(convert_workspace):
    root = convert_workspace
    hf_dir = save_tiny_family_model("glm4", root / "glm4")
    with pytest.raises(ValidationError, match=r"model_id=.* with to='hf': expected a Megatron checkpoint folder"):
        ConvertConfig(model_id=str(hf_dir), to="hf")
    with pytest.raises(NotMegatronCapableError, match=r"GLM-4.*cannot be converted to megatron-core"):
        convert_checkpoint(ConvertConfig(model_id=str(hf_dir), to="megatron"))
