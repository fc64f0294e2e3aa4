"""Original (remote-code) InternVL checkpoints resolve to a native `internvl` conversion, built without their code."""
from __future__ import annotations

import json
import sys

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForImageTextToText, AutoTokenizer
from vision_models import INTERNVL_CHAT_CODE, tiny_native_internvl, write_image, write_internvl_chat

from twinkle_core.data import get_row_format
from twinkle_core.families import family_for_model_dir
from twinkle_core.hub import HubError, resolve_model
from twinkle_core.hub.internvl import UnsupportedInternVLError, is_internvl_chat

ROW_FORMAT = get_row_format("vision_chat")


def _logits(model_dir, image_dir):
    """The logits of the model in `model_dir` on one encoded row with a 2-tile image (3 tiles with the
    thumbnail), through the project's own InternVL encoder."""
    messages = [{"role": "user", "content": "<image>What colour is it?"}, {"role": "assistant", "content": "Red."}]
    row = ROW_FORMAT.check({"messages": messages, "images": ["wide.png"]}, image_dir)
    encoder = ROW_FORMAT.load_encoder(AutoTokenizer.from_pretrained(model_dir), model_dir)
    batch = ROW_FORMAT.collate([ROW_FORMAT.encode(encoder, row)], pad_token_id=encoder.tokenizer.pad_token_id)
    assert batch["pixel_values"].shape[0] == 3
    model = AutoModelForImageTextToText.from_pretrained(model_dir).eval()
    with torch.no_grad():
        return batch, model(**{k: v for k, v in batch.items() if k != "mm_token_type_ids"}).logits


@pytest.mark.parametrize("text,qk_norm,tied", [("llama", False, False), ("llama", True, False),
                                                ("qwen2", False, True)],
                         ids=["internlm2", "internlm2-qk-norm-rmsnorm-vit", "qwen2-tied"])
def test_original_internvl_converts_to_the_native_model_exactly(tmp_path, text, qk_norm, tied):
    native, tokenizer = tiny_native_internvl(text, qk_norm=qk_norm, tied=tied)
    native.save_pretrained(tmp_path / "native")
    tokenizer.save_pretrained(tmp_path / "native")
    (tmp_path / "native" / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "GotOcr2ImageProcessor", "size": {"height": 56, "width": 56},
        "crop_to_patches": True, "min_patches": 1, "max_patches": 4}))
    source = write_internvl_chat(tmp_path / "InternVL2_5-8B", native, tokenizer)
    assert is_internvl_chat(source)
    assert any(k.endswith("attn.qkv.weight") for k in load_file(source / "model.safetensors"))

    resolved = resolve_model(str(source))
    assert resolved.path != source and not any(resolved.path.glob("*.py"))
    assert not any(module in sys.modules for module in INTERNVL_CHAT_CODE)
    config = json.loads((resolved.path / "config.json").read_text())
    assert config["model_type"] == "internvl" and config["architectures"] == ["InternVLForConditionalGeneration"]
    assert config["text_config"]["model_type"] == text and "auto_map" not in config
    assert config["image_token_id"] == tokenizer.convert_tokens_to_ids("<IMG_CONTEXT>")
    assert config["image_seq_length"] == 4 and config["tie_word_embeddings"] is tied
    assert ("lm_head.weight" in load_file(resolved.path / "model.safetensors")) is not tied
    assert family_for_model_dir(resolved.path, vision=True).name == "internvl2_5"
    # what transformers' InternVLProcessor reads (it needs torchvision to be built; bench/check_stock_processors.py)
    named = AutoTokenizer.from_pretrained(resolved.path)
    assert (named.start_image_token, named.end_image_token, named.context_image_token) == ("<img>", "</img>",
                                                                                           "<IMG_CONTEXT>")
    assert [named.start_image_token_id, named.end_image_token_id, named.context_image_token_id] == \
        tokenizer.convert_tokens_to_ids(["<img>", "</img>", "<IMG_CONTEXT>"])
    assert json.loads((resolved.path / "processor_config.json").read_text())["image_seq_length"] == 4

    converted = AutoModelForImageTextToText.from_pretrained(resolved.path)
    expected, actual = native.state_dict(), converted.state_dict()
    assert sorted(actual) == sorted(expected)
    unequal = [name for name in expected if not torch.equal(actual[name], expected[name])]
    assert unequal == []

    write_image(tmp_path / "wide.png", size=(112, 56), seed=1)
    batch, want = _logits(tmp_path / "native", tmp_path)
    batch_converted, got = _logits(resolved.path, tmp_path)
    assert torch.equal(batch["input_ids"], batch_converted["input_ids"])
    assert torch.equal(batch["pixel_values"], batch_converted["pixel_values"])
    assert torch.equal(got, want)
    image_positions = batch["input_ids"][0] == config["image_token_id"]
    assert int(image_positions.sum()) == 12  # 3 tiles x 4 context tokens: the image reached the logits
    assert resolve_model(str(source)).path == resolved.path  # converted once, then reused


def test_unsupported_language_model_is_a_clear_error(tmp_path):
    native, tokenizer = tiny_native_internvl("qwen2")
    source = write_internvl_chat(tmp_path / "InternVL3-9B", native, tokenizer, llm_architecture="InternLM3ForCausalLM")
    with pytest.raises(UnsupportedInternVLError) as error:
        resolve_model(str(source))
    message = str(error.value)
    assert "InternVL3-9B" in message and "InternLM3ForCausalLM" in message and "InternLM2ForCausalLM" in message
    assert isinstance(error.value, HubError)
    models = tmp_path / "twinkle_cache"
    assert not [path for path in models.rglob("config.json") if "internvl" in str(path)]  # nothing cached


def test_a_vocab_and_merges_tokenizer_of_a_built_in_class_is_converted(tmp_path):
    """InternVL2_5-1B-style: no tokenizer.json, a Qwen2Tokenizer's vocab.json + merges.txt, added tokens in
    tokenizer_config.json."""
    native, tokenizer = tiny_native_internvl("qwen2")
    source = write_internvl_chat(tmp_path / "InternVL2_5-1B", native, tokenizer)
    tokenizer.backend_tokenizer.model.save(str(source))  # vocab.json, merges.txt
    (source / "tokenizer.json").unlink()
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<img>", "</img>", "<IMG_CONTEXT>"]
    settings = json.loads((source / "tokenizer_config.json").read_text())
    settings.update(tokenizer_class="Qwen2Tokenizer", added_tokens_decoder={
        str(tokenizer.convert_tokens_to_ids(token)): {"content": token, "special": True, "lstrip": False,
                                                      "rstrip": False, "normalized": False, "single_word": False}
        for token in special})
    settings.pop("auto_map")
    (source / "tokenizer_config.json").write_text(json.dumps(settings))

    resolved = resolve_model(str(source))
    converted = AutoTokenizer.from_pretrained(resolved.path)
    context = tokenizer.convert_tokens_to_ids("<IMG_CONTEXT>")
    assert json.loads((resolved.path / "config.json").read_text())["image_token_id"] == context
    assert converted("<img><IMG_CONTEXT><IMG_CONTEXT></img>")["input_ids"] == [
        tokenizer.convert_tokens_to_ids(token) for token in ("<img>", "<IMG_CONTEXT>", "<IMG_CONTEXT>", "</img>")]


def test_missing_llm_config_is_a_clear_error(tmp_path):
    native, tokenizer = tiny_native_internvl("qwen2")
    source = write_internvl_chat(tmp_path / "InternVL2_5-1B", native, tokenizer)
    config = json.loads((source / "config.json").read_text())
    del config["llm_config"]
    (source / "config.json").write_text(json.dumps(config))
    with pytest.raises(HubError, match=r"InternVL2_5-1B.*lacks \['llm_config'\]"):
        resolve_model(str(source))
