"""The convert flow under a real Prefect API: HF → Megatron (tp=1, and tp=2 under torchrun) → HF, bit-exact and
cached, and its refusals."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM

from family_models import save_tiny_family_model
from tiny_models import make_tiny_tokenizer, randomize_norms
from flows.convert import ConvertConfig, convert_checkpoint, main
from twinkle_core.convert import NotMegatronCapableError


@pytest.fixture
def convert_workspace(tmp_path, monkeypatch, prefect_harness):
    monkeypatch.setenv("TWINKLE_CACHE", str(tmp_path / "cache"))
    return tmp_path


def tiny_qwen3(directory: Path) -> Path:
    """Qwen3 as its checkpoints are shaped: RMSNorm on each q/k head (random here, so a wrong mapping shows),
    8 query heads over 2 key/value heads (GQA 4:1), head_dim ≠ hidden/heads, and a vocabulary of 300 that
    megatron pads (to 384 at tp=1, 512 at tp=2) and the export must cut back."""
    config = AutoConfig.for_model("qwen3", vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                  num_attention_heads=8, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False,
                                  rms_norm_eps=1e-6, max_position_embeddings=4096,
                                  rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    randomize_norms(model)
    model.save_pretrained(directory)
    make_tiny_tokenizer(chat_template=None).save_pretrained(directory)
    return directory


@pytest.mark.parametrize("tp", [1, 2])
def test_qwen3_hf_to_megatron_and_back_is_bit_exact_and_cached(convert_workspace, capsys, tp):
    root = convert_workspace
    source = tiny_qwen3(root / "qwen3")
    assert main(["--model-id", str(source), "--to", "megatron", "--tp", str(tp), "--output", str(root / "mcore")]) == 0
    assert capsys.readouterr().out.strip().endswith(str(root / "mcore"))
    for part in ("twinkle_megatron.json", "megatron/metadata.json", "hf/config.json", "hf/tokenizer.json"):
        assert (root / "mcore" / part).is_file(), part
    assert json.loads((root / "mcore" / "twinkle_megatron.json").read_text())["family"] == "qwen3"

    again = convert_checkpoint(ConvertConfig(model_id=str(source), to="megatron", tp=tp))
    cached = next((root / "cache" / "conversions").glob(f"megatron-qwen3-tp{tp}pp1-*"))
    assert again["cached"] == str(cached) and again["family"] == "qwen3"
    assert len(list((root / "cache" / "conversions").iterdir())) == 1  # converted once

    assert main(["--model-id", str(root / "mcore"), "--to", "hf", "--tp", str(tp), "--output", str(root / "hf")]) == 0
    original, exported = load_file(source / "model.safetensors"), load_file(root / "hf" / "model.safetensors")
    assert sorted(exported) == sorted(original)
    assert exported["model.embed_tokens.weight"].shape == (300, 64)
    for name, tensor in original.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name
    model = AutoModelForCausalLM.from_pretrained(root / "hf")
    assert model.config.model_type == "qwen3"


def test_refusals_name_the_option(convert_workspace):
    root = convert_workspace
    hf_dir = save_tiny_family_model("glm4", root / "glm4")
    with pytest.raises(ValidationError, match=r"model_id=.* with to='hf': expected a Megatron checkpoint folder"):
        ConvertConfig(model_id=str(hf_dir), to="hf")
    with pytest.raises(NotMegatronCapableError, match=r"GLM-4.*cannot be converted to megatron-core"):
        convert_checkpoint(ConvertConfig(model_id=str(hf_dir), to="megatron"))
