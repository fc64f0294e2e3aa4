"""Control: a tiny Qwen2.5-VL trained on rows whose answer is the colour of the image uses the image. After
training, its held-out loss with the real images is far below its loss on the same rows with a grey image of
the same size in their place; before training the two are equal."""
from __future__ import annotations

import random

import torch
from PIL import Image
from vision_models import save_tiny_qwen2_5_vl

from twinkle_core.data import get_row_format
from twinkle_core.models import TransformersModel

COLOURS = {"Red.": (220, 30, 30), "Green.": (30, 160, 60), "Blue.": (40, 70, 220), "Yellow.": (240, 200, 20),
           "Purple.": (140, 50, 170), "Orange.": (245, 130, 20)}  # the vision_shapes set's colours
GREY = (128, 128, 128)
ROW_FORMAT = get_row_format("vision_chat")


def _rows(folder, count: int, seed: int) -> list[dict]:
    """`count` one-colour 56x56 pictures, each colour shifted by a seeded amount per channel, asked their colour."""
    rng, rows = random.Random(seed), []
    for index in range(count):
        answer, rgb = list(COLOURS.items())[index % len(COLOURS)]
        path = folder / f"{seed}-{index}.png"
        Image.new("RGB", (56, 56), tuple(min(255, max(0, c + rng.randint(-25, 25))) for c in rgb)).save(path)
        rows.append({"messages": [{"role": "user", "content": "<image>What colour is it?"},
                                  {"role": "assistant", "content": answer}], "images": [str(path)]})
    return rows


def _batch(model, rows: list[dict]) -> dict[str, torch.Tensor]:
    examples = [ROW_FORMAT.encode(model.encoder, ROW_FORMAT.check(row)) for row in rows]
    return ROW_FORMAT.collate(examples, pad_token_id=model.tokenizer.pad_token_id)


def test_after_training_the_real_image_gives_a_far_lower_loss_than_a_grey_one(tmp_path):
    train, heldout = _rows(tmp_path, 36, seed=0), _rows(tmp_path, 12, seed=1)  # held-out shades are new
    Image.new("RGB", (56, 56), GREY).save(tmp_path / "grey.png")
    blanked = [dict(row, images=[str(tmp_path / "grey.png")]) for row in heldout]
    # Full training with the merger unfrozen (vision tower frozen) learns fastest here: 40 steps of 9 rows.
    model = TransformersModel(str(save_tiny_qwen2_5_vl(tmp_path / "model")), mixed_precision="no",
                              objective="vision_lm", objective_options={"freeze_aligner": False})
    model.set_optimizer("AdamW", lr=1e-2)
    batches = [_batch(model, train[i:i + 9]) for i in range(0, len(train), 9)]
    real_batch, grey_batch = _batch(model, heldout), _batch(model, blanked)
    before = model.forward_only(real_batch), model.forward_only(grey_batch)
    losses = []
    for step in range(40):
        losses.append(model.forward_backward(batches[step % len(batches)]))
        model.clip_grad_and_step(max_grad_norm=1.0)
    real, grey = model.forward_only(real_batch), model.forward_only(grey_batch)
    shown = f"before: real {before[0]:.4f} grey {before[1]:.4f}; after: real {real:.4f} grey {grey:.4f}; " \
            f"train loss {losses[0]:.3f} -> {losses[-1]:.3f}"
    # Measured (2 CPU cores): before 5.9401 / 5.9347; after real 0.138, grey 1.366 (train loss 5.94 -> 0.17).
    assert abs(before[0] - before[1]) < 0.05, shown  # untrained, the image makes no difference
    assert real < 0.3, shown
    assert grey - real > 0.8, shown  # the answer comes from the image
