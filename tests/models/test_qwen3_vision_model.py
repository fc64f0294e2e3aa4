"""Tiny Qwen3-VL and Qwen 3.5 VL models of the real classes train on encoded image (and, for Qwen3-VL, video)
rows through TransformersModel: LoRA stays on the language model, the vision tower stays fixed, the loss falls,
mm_token_type_ids reaches the model (both raise without it) and their 3-D rope index on our batch is the one
the token layout gives."""
from __future__ import annotations

import pytest
import torch
from peft import LoraConfig
from transformers import AutoTokenizer
from vision_models import save_tiny_qwen3_5_vl, save_tiny_qwen3_vl, write_image, write_video

from twinkle_core.data.vision_collate import collate_vision
from twinkle_core.data.vision_encode import encode_vision_row, load_vision_processor
from twinkle_core.families import family_for_model_dir
from twinkle_core.models import TransformersModel

COLOURS = {"red": (255, 0, 0), "green": (0, 255, 0), "blue": (0, 0, 255)}
SAVERS = {"qwen3_vl": save_tiny_qwen3_vl, "qwen3_5_vl": save_tiny_qwen3_5_vl}


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    folder = tmp_path_factory.mktemp("media")
    images = {name: str(write_image(folder / f"{name}.png", rgb, size=(64, 64))) for name, rgb in COLOURS.items()}
    # 8 frames at 4 fps, sampled at 2 fps: 5 frames (both ends), 3 frame groups of 2
    return images, str(write_video(folder / "clip.mp4", frames=8, fps=4, size=(64, 64)))


def _rows(media, video: bool) -> list[dict]:
    images, clip = media
    rows = [{"messages": [{"role": "user", "content": "<image>What colour is it?"},
                          {"role": "assistant", "content": f"It is {name}."}], "images": [path]}
            for name, path in images.items()]
    if video:
        rows.append({"messages": [{"role": "user", "content": "<video>What moves?"},
                                  {"role": "assistant", "content": "Noise."}], "videos": [clip]})
    return rows


def _layout_positions(types: list[int]) -> torch.Tensor:
    """[3, n] positions from the token layout alone: text counts on in all three axes; a run of media tokens
    (a square of side s merged patches, one frame group) sits at t = p, h = p + row, w = p + column, and the
    text after it continues at p + s."""
    rows, position, i = [], 0, 0
    while i < len(types):
        j = i
        while j < len(types) and types[j] == types[i]:
            j += 1
        if types[i] == 0:
            rows += [(p, p, p) for p in range(position, position + j - i)]
            position += j - i
        else:
            side = int((j - i) ** 0.5)
            assert side * side == j - i
            rows += [(position, position + k // side, position + k % side) for k in range(j - i)]
            position += side
        i = j
    return torch.tensor(rows).T


@pytest.mark.parametrize("family, video", [("qwen3_vl", True), ("qwen3_5_vl", False)])
def test_lora_trains_the_language_model_on_encoded_media_and_the_rope_index_follows_the_layout(
        family, video, media, tmp_path):
    model_dir = SAVERS[family](tmp_path / family)
    assert family_for_model_dir(model_dir, vision=True).name == family
    model = TransformersModel(str(model_dir), mixed_precision="no", objective="vision_lm")
    assert model.family.name == family and type(model.model).__name__.endswith("ForConditionalGeneration")
    rows = _rows(media, video)

    # The encoded batch: 4 image tokens per 64x64 image; a video is timestamped groups of 4 tokens.
    processor = load_vision_processor(AutoTokenizer.from_pretrained(model_dir), model_dir)
    batch = collate_vision([encode_vision_row(processor, row) for row in rows], processor.tokenizer.pad_token_id)
    assert batch["image_grid_thw"].tolist() == [[1, 4, 4]] * 3
    types = batch["mm_token_type_ids"]
    assert [(row == 1).sum().item() for row in types[:3]] == [4, 4, 4]
    if video:
        # 5 of the 8 frames (0, 2, 3, 5, 7: nearest to 5 even steps over 0..1.75 s), in groups (0, 2), (3, 5),
        # (7, 7 again), each stamped with its mean time as the stock processor's own timestamp rule gives it
        from transformers import Qwen3VLProcessor

        assert batch["video_grid_thw"].tolist() == [[3, 4, 4]] and (types[3] == 2).sum().item() == 12
        stock = Qwen3VLProcessor._calculate_timestamps(None, [0, 2, 3, 5, 7], 4.0, 2)
        assert [f"{t:.1f}" for t in stock] == ["0.2", "1.0", "1.8"]
        frame = "<|vision_start|>" + "<|video_pad|>" * 4 + "<|vision_end|>"
        text = processor.tokenizer.decode(batch["input_ids"][3])
        assert f"<0.2 seconds>{frame}<1.0 seconds>{frame}<1.8 seconds>{frame}What moves?" in text

    # The model's rope index on our batch is the layout's, row by row (padding excluded).
    rope_args = {key: batch[key] for key in ("image_grid_thw", "video_grid_thw") if key in batch}
    positions, _ = model.model.model.get_rope_index(batch["input_ids"], types, attention_mask=batch["attention_mask"],
                                                    **rope_args)
    for b in range(len(rows)):
        keep = batch["attention_mask"][b].bool()
        assert torch.equal(positions[:, b, keep], _layout_positions(types[b, keep].tolist()))
    first = types[0].tolist().index(1)  # hand-checked: the image's 2x2 tokens after `first` text tokens
    assert positions[:, 0, first:first + 5].tolist() == [[first] * 4 + [first + 2],
                                                         [first, first, first + 1, first + 1, first + 2],
                                                         [first, first + 1, first, first + 1, first + 2]]
    without = {k: v for k, v in batch.items() if k not in ("mm_token_type_ids", "labels")}
    with pytest.raises(ValueError, match="mm_token_type_ids"):
        model.model(**{k: v for k, v in without.items() if k != "second_per_grid_ts"})

    model.add_adapter_to_model("default", LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
    adapted = {name.replace("base_model.model.", "").rsplit(".lora_A", 1)[0]
               for name, _ in model.model.named_modules() if name.endswith("lora_A")}
    assert adapted and {model.family.vision.part_of(name) for name in adapted} == {"language_model"}, sorted(adapted)
    visual = {n: p.detach().clone() for n, p in model.model.named_parameters() if ".visual." in n}
    model.set_optimizer("AdamW", lr=1e-2)
    losses = []
    for _ in range(6):
        losses.append(model.forward_backward(inputs=rows))
        model.clip_grad_and_step(max_grad_norm=1.0)
    assert losses[-1] < losses[0] - 0.5, losses
    after = dict(model.model.named_parameters())
    assert visual and all(torch.equal(p, after[n]) for n, p in visual.items())
