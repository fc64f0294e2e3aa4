"""Packed vision-language rows train as each row alone: one sequence holds several samples with their images and
videos, each sample keeps the 3-D M-RoPE positions it has alone (Qwen) or restarts its 1-D positions (InternVL),
and the block-causal mask keeps samples apart. Qwen 3.5 VL, whose gated-delta-net layers would carry one
sample's state into the next, is refused."""
from __future__ import annotations

import inspect
import json

import pytest
import torch
from transformers import AutoConfig
from vision_models import VL_FAMILIES, family_rows

from flows.sft import SFTConfig

from twinkle_core.data import get_row_format, load_tokenized, tokenize_dataset
from twinkle_core.data.vision_encode import encode_vision_row
from twinkle_core.data.vision_collate import pack_vision_examples
from twinkle_core.models import TransformersModel
from twinkle_core.train.checks import run_problems
from twinkle_core.objectives.vision import packed_positions, vision_lm_loss_sum

ROW_FORMAT = get_row_format("vision_chat")


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl", "internvl2_5"])
def test_a_packed_sequence_gives_each_samples_loss_and_positions(family, tmp_path):
    save, side, video = VL_FAMILIES[family]
    model = TransformersModel(str(save(tmp_path / family)), mixed_precision="no", objective="vision_lm")
    rows = family_rows(tmp_path / "media", side, video)
    examples = [encode_vision_row(model.encoder, row) for row in rows]
    pad = model.tokenizer.pad_token_id
    packs = pack_vision_examples(examples, max_length=sum(len(e["input_ids"]) for e in examples))
    assert len(packs) == 1 and packs[0]["position_ids"].count(0) == len(examples)
    batch = ROW_FORMAT.collate(packs, pad_token_id=pad)
    assert batch["attention_mask"].shape[-2:] == (len(packs[0]["input_ids"]),) * 2  # the block-causal mask
    network = model.model.eval()
    with torch.no_grad():
        packed = vision_lm_loss_sum(network, batch)
        # alone, each sample's first label untrained, as packing leaves it
        alone = [vision_lm_loss_sum(network, ROW_FORMAT.collate([dict(e, labels=[-100] + e["labels"][1:])], pad))
                 for e in examples]
    assert packed.num_tokens == sum(part.num_tokens for part in alone)
    expected = sum(float(part.loss_sum) for part in alone)
    assert float(packed.loss_sum) == pytest.approx(expected, rel=1e-6)  # measured 8.4e-8 (Qwen2.5-VL), 5.6e-8, 0
    # through the model's own API, as training calls it: the mean over the same trained tokens
    assert model.forward_only(batch) == pytest.approx(expected / packed.num_tokens, rel=1e-6)

    positions = packed_positions(network, batch)["position_ids"]
    if family == "internvl2_5":  # 1-D positions: restarted per sample, as packed text
        assert positions is batch["position_ids"]
        return
    assert positions.shape == (4, 1, batch["input_ids"].shape[1])  # text positions, then t, h, w
    owner = next(m for m in network.modules() if hasattr(m, "get_rope_index"))
    names = inspect.signature(owner.get_rope_index).parameters
    keys = [k for k in ("input_ids", "mm_token_type_ids", "image_grid_thw", "video_grid_thw", "second_per_grid_ts")
            if k in names]
    start = 0
    for example in examples:  # each sample's 3-D positions are exactly those the model gives it alone
        single = ROW_FORMAT.collate([example], pad)
        own, _ = owner.get_rope_index(**{k: single[k] for k in keys if k in single})
        length = len(example["input_ids"])
        assert torch.equal(positions[1:, :, start:start + length], own), family
        start += length


def test_packed_vision_rows_are_cached_and_read_back(tmp_path):
    save, side, video = VL_FAMILIES["qwen2_5_vl"]
    model_dir = save(tmp_path / "qwen2_5_vl")
    rows = family_rows(tmp_path / "media", side, video)
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows * 2))
    unpacked = load_tokenized(tokenize_dataset(data, model_dir, kind="vision_chat", max_length=512).path)
    result = tokenize_dataset(data, model_dir, kind="vision_chat", max_length=512, packing=True)
    packed = load_tokenized(result.path)
    assert result.num_rows == len(packed) < len(unpacked) == 6
    expected = pack_vision_examples(unpacked, 512)
    assert [p["input_ids"] for p in packed] == [p["input_ids"] for p in expected]
    for got, want in zip(packed, expected):
        for key in ("position_ids", "labels", "mm_token_type_ids", "image_rows", "video_rows", "image_grid_thw",
                    "video_grid_thw"):
            assert list(got[key]) == list(want[key]), key
        assert got["pixel_values"] == pytest.approx(want["pixel_values"])


def test_qwen3_5_vl_packing_is_refused_for_its_recurrent_layers(tmp_path):
    save, _, _ = VL_FAMILIES["qwen3_5_vl"]
    model_dir = save(tmp_path / "Qwen" / "Qwen3.5-VL-3B")
    (tmp_path / "rows.jsonl").write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}\n')
    config = SFTConfig(model_id=str(model_dir), dataset=str(tmp_path / "rows.jsonl"), packing=True)
    assert config.objective == "vision_lm"
    problems = run_problems(config, AutoConfig.from_pretrained(model_dir))
    assert [p for p in problems if p.startswith("packing=True")] == [
        "packing=True: this model's linear_attention layers carry their state from one packed sample into the next "
        "(a mask keeps samples apart in attention only; transformers separates them there only with "
        "flash-linear-attention kernels and cu_seqlens, not used here); use packing=false"]
