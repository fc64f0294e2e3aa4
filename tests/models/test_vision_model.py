"""A tiny Qwen2.5-VL trains on image rows through TransformersModel: frozen parts stay fixed, LoRA stays on the
language model, the image reaches the loss."""
from __future__ import annotations

import pytest
import torch
from peft import LoraConfig
from vision_models import save_tiny_qwen2_5_vl, write_image

from twinkle_core.models import TransformersModel

COLOURS = {"red": (255, 0, 0), "green": (0, 255, 0), "blue": (0, 0, 255), "white": (255, 255, 255)}


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
    from vision_models import save_tiny_internvl

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
