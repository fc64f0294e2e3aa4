"""A tiny Qwen2.5-VL trains on image rows through TransformersModel: frozen parts stay fixed, LoRA stays on the
language model, the image reaches the loss, bf16 and fp16 train it. Every VL family: labels, media in the loss,
a full checkpoint's reload."""
from __future__ import annotations

import math

import pytest
import torch
from peft import LoraConfig
from vision_models import COLOURS, VL_FAMILIES, family_rows, save_tiny_internvl, save_tiny_qwen2_5_vl, write_image

from twinkle_core.data import get_row_format
from twinkle_core.data.vision_encode import encode_vision_row
from twinkle_core.models import TransformersModel
from twinkle_core.objectives.vision import accepted_inputs

@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_qwen2_5_vl(tmp_path_factory.mktemp("qwen_vl") / "model")


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    folder = tmp_path_factory.mktemp("images")
    return [{"messages": [{"role": "user", "content": "<image>What colour is it?"},
                          {"role": "assistant", "content": f"It is {name}."}],
             "images": [str(write_image(folder / f"{name}.png", rgb))]} for name, rgb in COLOURS.items()]


def _weights(model, part: str) -> dict[str, torch.Tensor]:
    parts = model.family.vision
    return {n: p.detach().clone() for n, p in model.model.named_parameters()
            if parts.part_of(n.replace("base_model.model.", "")) == part and "lora_" not in n}


def _train(model, rows, steps: int) -> list[float]:
    losses = []
    for _ in range(steps):
        losses.append(model.forward_backward(inputs=rows))
        model.clip_grad_and_step(max_grad_norm=1.0)
    return losses


def test_lora_trains_the_language_model_only_and_the_loss_falls(model_dir, rows):
    model = TransformersModel(str(model_dir), mixed_precision="no", objective="vision_lm")
    model.add_adapter_to_model("default", LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
    adapted = {name.rsplit(".lora_A", 1)[0] for name, _ in model.model.named_modules() if name.endswith("lora_A")}
    assert adapted and all(".language_model." in name for name in adapted), sorted(adapted)
    assert len(adapted) == 2 * 7  # q, k, v, o, gate, up, down in each of the 2 layers; none in the vision tower
    vision, aligner = _weights(model, "vision_tower"), _weights(model, "aligner")
    model.set_optimizer("AdamW", lr=1e-2)
    losses = _train(model, rows, 10)
    assert losses[-1] < losses[0] - 0.5, losses  # as the language families' LoRA tests
    for before, after in ((vision, _weights(model, "vision_tower")), (aligner, _weights(model, "aligner"))):
        assert before.keys() == after.keys() and all(torch.equal(before[n], after[n]) for n in before)


def test_full_training_with_an_unfrozen_aligner_moves_it_and_keeps_the_vision_tower(model_dir, rows):
    model = TransformersModel(str(model_dir), mixed_precision="no", objective="vision_lm",
                              objective_options={"freeze_aligner": False})
    trainable = {model.family.vision.part_of(n) for n, p in model.model.named_parameters() if p.requires_grad}
    assert trainable == {"aligner", "language_model"}
    vision, aligner = _weights(model, "vision_tower"), _weights(model, "aligner")
    model.set_optimizer("AdamW", lr=1e-3)
    losses = _train(model, rows, 3)
    assert losses[-1] < losses[0], losses
    assert all(torch.equal(vision[n], p) for n, p in _weights(model, "vision_tower").items())
    assert not all(torch.equal(aligner[n], p) for n, p in _weights(model, "aligner").items())


def test_the_image_reaches_the_loss_and_freezing_everything_is_refused(model_dir, rows, tmp_path):
    model = TransformersModel(str(model_dir), mixed_precision="no", objective="vision_lm")
    changed = dict(rows[0], images=[str(write_image(tmp_path / "dot.png", (255, 0, 0)))])
    from PIL import Image

    with Image.open(changed["images"][0]) as image:  # one pixel of the red image turned blue
        image = image.copy()
    image.putpixel((10, 10), (0, 0, 255))
    image.save(changed["images"][0])
    assert model.forward_only([rows[0]]) != model.forward_only([changed])
    unfrozen = TransformersModel(str(model_dir), mixed_precision="no", objective="vision_lm",
                                 objective_options={"freeze_vision": False})
    unfrozen.add_adapter_to_model("default", LoraConfig(r=4, target_modules="all-linear"))
    adapted = {unfrozen.family.vision.part_of(name.replace("base_model.model.", "").rsplit(".lora_A", 1)[0])
               for name, _ in unfrozen.model.named_modules() if name.endswith("lora_A")}
    assert adapted == {"vision_tower", "language_model"}  # the frozen merger stays without LoRA
    with pytest.raises(ValueError, match="nothing would train"):
        TransformersModel(str(model_dir), mixed_precision="no", objective="vision_lm",
                          objective_options={"freeze_llm": True})


def test_internvl_lora_stays_on_its_language_model_and_trains(rows, tmp_path):
    model = TransformersModel(str(save_tiny_internvl(tmp_path / "internvl")), mixed_precision="no",
                              objective="vision_lm")
    assert model.family.name == "internvl2_5"
    model.add_adapter_to_model("default", LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
    parts = {model.family.vision.part_of(name.replace("base_model.model.", "").rsplit(".lora_A", 1)[0])
             for name, _ in model.model.named_modules() if name.endswith("lora_A")}
    assert parts == {"language_model"}
    projector = _weights(model, "aligner")
    model.set_optimizer("AdamW", lr=1e-2)
    losses = _train(model, rows, 4)
    assert losses[-1] < losses[0], losses
    assert all(torch.equal(projector[n], p) for n, p in _weights(model, "aligner").items())


@pytest.fixture(scope="module")
def fp32_loss(model_dir, rows):
    return TransformersModel(str(model_dir), mixed_precision="no", objective="vision_lm").forward_only(rows[:2])


@pytest.mark.parametrize("precision,lora", [("bf16", True), ("bf16", False), ("fp16", True), ("fp16", False)],
                         ids=["bf16-lora", "bf16-full", "fp16-lora", "fp16-full"])
def test_bf16_and_fp16_train_lora_and_full(model_dir, rows, fp32_loss, precision, lora):
    """CPU autocast in bf16 / fp16. Trainable weights stay fp32 masters; LoRA stores the frozen base in the
    compute dtype, full training keeps every weight fp32 (so a saved full checkpoint carries the frozen vision
    tower unrounded). fp16's loss scaler skips the first steps (measured: 3) while it backs off from 2**16."""
    model = TransformersModel(str(model_dir), mixed_precision=precision, objective="vision_lm")
    torch.manual_seed(0)  # LoRA's random start, whatever ran before
    if lora:
        model.add_adapter_to_model("default", LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
    half = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    dtypes = {(p.requires_grad, p.dtype) for p in model.model.parameters()}
    assert dtypes == {(True, torch.float32), (False, half if lora else torch.float32)}, dtypes
    # The untrained model's loss in half precision: within 1e-3 relative of fp32 (measured at most 1.1e-5).
    assert model.forward_only(rows[:2]) == pytest.approx(fp32_loss, rel=1e-3)
    model.set_optimizer("AdamW", lr=1e-2 if lora else 1e-3)
    losses = _train(model, rows[:2], 8 if precision == "fp16" else 4)
    assert all(math.isfinite(loss) for loss in losses), losses
    if precision == "fp16":
        assert losses[1] == losses[0], losses  # the scaled first step overflowed and was skipped
    assert losses[-1] < losses[0] - 0.5, losses  # measured drops 0.73 to 0.90


def _logits(model, batch) -> torch.Tensor:
    model.model.eval()
    with torch.no_grad():
        return model.model(**{k: v for k, v in accepted_inputs(model.model, batch).items() if k != "labels"}).logits


@pytest.mark.parametrize("family", list(VL_FAMILIES))
def test_each_family_labels_the_reply_its_media_reach_the_loss_and_a_full_checkpoint_reloads(family, tmp_path):
    """Every family: the labels are exactly the assistant's text, one changed pixel value of an image (and of a
    video) changes the loss, and a fully trained checkpoint with its vision tower unfrozen, reloaded on its own,
    encodes the rows the same way and gives the same logits."""
    save, side, video = VL_FAMILIES[family]
    model_dir = save(tmp_path / family)
    options = {"freeze_vision": False, "freeze_aligner": False}
    model = TransformersModel(str(model_dir), mixed_precision="no", objective="vision_lm", objective_options=options)
    assert model.family.name == family
    rows = family_rows(tmp_path / "media", side, video)
    examples = [encode_vision_row(model.encoder, row) for row in rows]
    tokenizer = model.tokenizer
    # Qwen 3.5's generation prompt opens the think block, so its model learns to close the empty one first,
    # as the text family does (tests/data/test_data_encode.py).
    think = "\n</think>\n\n" if family == "qwen3_5_vl" else ""
    for row, example in zip(rows, examples):
        trained = [t for t, label in zip(example["input_ids"], example["labels"]) if label != -100]
        assert tokenizer.decode(trained) == think + row["messages"][-1]["content"] + "<|im_end|>"
    collate = get_row_format("vision_chat").collate
    batch = collate(examples, pad_token_id=tokenizer.pad_token_id)
    loss = model.forward_only(batch)
    for key in ("pixel_values", "pixel_values_videos") if video else ("pixel_values",):
        changed = dict(batch, **{key: batch[key].clone()})
        changed[key][0, 0] += 0.5  # one value of the first patch row
        assert model.forward_only(changed) != loss, key

    model.set_optimizer("AdamW", lr=1e-3)
    model.forward_backward(inputs=batch)
    model.clip_grad_and_step(max_grad_norm=1.0)
    saved = model.save("model", tmp_path / "out")
    expected = _logits(model, batch)
    fresh = TransformersModel(str(saved), mixed_precision="no", objective="vision_lm", objective_options=options)
    again = collate([encode_vision_row(fresh.encoder, row) for row in rows],
                    pad_token_id=fresh.tokenizer.pad_token_id)
    assert batch.keys() == again.keys() and all(torch.equal(again[key], batch[key]) for key in batch)
    torch.testing.assert_close(_logits(fresh, again), expected, rtol=0, atol=1e-6)
