"""Qwen2.5-VL encoding: media tokens, labels on the replies only, 3-D positions, video patches, the cache."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoTokenizer
from vision_models import (qwen_vl_tokenizer, save_tiny_qwen2_5_vl, save_tiny_qwen3_vl, tiny_qwen2_5_vl, write_image,
                           write_video)

from twinkle_core.data import get_row_format, load_tokenized, tokenize_dataset
from twinkle_core.data.vision_encode import MediaOptions

ROW_FORMAT = get_row_format("vision_chat")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_qwen2_5_vl(tmp_path_factory.mktemp("qwen_vl") / "model")


@pytest.fixture(scope="module")
def processor(model_dir):
    return ROW_FORMAT.load_encoder(qwen_vl_tokenizer(), model_dir)


def _row(folder, question="<image>What colour is it?", answer="Red.", **media):
    messages = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    return ROW_FORMAT.check({"messages": messages, **media}, folder)


def test_image_tokens_pixels_and_labels_on_the_reply_only(tmp_path, processor):
    red = write_image(tmp_path / "red.png", size=(60, 50))  # resized to 56x56: 4x4 patches, 2x2 merged
    example = ROW_FORMAT.encode(processor, _row(tmp_path, images=["red.png"]))
    tokenizer = processor.tokenizer
    ids, types = example["input_ids"], example["mm_token_type_ids"]
    image_id = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert example["image_grid_thw"] == [[1, 4, 4]] and ids.count(image_id) == 4
    assert [i for i, t in enumerate(types) if t == 1] == [i for i, t in enumerate(ids) if t == image_id]
    assert set(types) == {0, 1}
    trained = [t for t, label in zip(ids, example["labels"]) if label != -100]
    assert tokenizer.decode(trained) == "Red.<|im_end|>"
    assert "<|vision_start|><|image_pad|><|image_pad|><|image_pad|><|image_pad|><|vision_end|>What colour" in \
        tokenizer.decode(ids)
    stock = processor.image_processor(images=[Image.open(red)])  # transformers' own PIL image processor
    assert np.array_equal(np.asarray(example["pixel_values"], dtype=np.float32).reshape(16, 1176),
                          np.asarray(stock["pixel_values"]))


def _expected_positions(text_before: int, grid_hw: tuple[int, int], text_after: int) -> torch.Tensor:
    """Qwen2.5-VL M-RoPE written out by hand: text counts 1-D; an image's merged tokens share t = start and
    take start + row / start + column; text after it resumes at start + max(rows, columns)."""
    rows, cols = grid_hw
    before = torch.arange(text_before).expand(3, -1)
    t = torch.full((rows * cols,), text_before)
    h = text_before + torch.arange(rows).repeat_interleave(cols)
    w = text_before + torch.arange(cols).repeat(rows)
    after = text_before + max(rows, cols) + torch.arange(text_after).expand(3, -1)
    return torch.cat([before, torch.stack([t, h, w]), after], dim=1)


def test_mrope_positions_survive_collation_and_padding(tmp_path, processor):
    write_image(tmp_path / "wide.png", size=(112, 56))  # 8x4 patches: 2 merged rows, 4 merged columns
    write_image(tmp_path / "red.png")
    rows = [_row(tmp_path, images=["wide.png"]),
            _row(tmp_path, "Look: <image>Is it red?", "Yes, it is red.", images=["red.png"])]
    size = dict(processor.image_processor.size)
    examples = [ROW_FORMAT.encode(processor, rows[0], max_pixels=112 * 56), ROW_FORMAT.encode(processor, rows[1])]
    assert dict(processor.image_processor.size) == size  # max_pixels is an option of the call, not a mutation
    batch = ROW_FORMAT.collate(examples, pad_token_id=processor.tokenizer.pad_token_id)
    assert batch["image_grid_thw"].tolist() == [[1, 4, 8], [1, 4, 4]]
    assert batch["pixel_values"].shape == (48, 1176)
    lengths = [len(e["input_ids"]) for e in examples]
    assert batch["mm_token_type_ids"].shape == batch["input_ids"].shape and lengths[0] < lengths[1]
    assert batch["mm_token_type_ids"][0, lengths[0]:].eq(0).all()  # padding is text
    model = tiny_qwen2_5_vl(processor.tokenizer)
    positions, _ = model.model.get_rope_index(batch["input_ids"], batch["mm_token_type_ids"], batch["image_grid_thw"],
                                              attention_mask=batch["attention_mask"])
    for index, (grid, example) in enumerate(zip([(2, 4), (2, 2)], examples)):
        start = example["mm_token_type_ids"].index(1)
        after = lengths[index] - start - grid[0] * grid[1]
        assert torch.equal(positions[:, index, :lengths[index]], _expected_positions(start, grid, after))
    assert positions[:, 0, lengths[0]:].eq(0).all()
    # Without mm_token_type_ids the model silently runs 1-D positions: the logits differ.
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    with torch.no_grad():
        with_types = model(**inputs).logits
        without = model(**{k: v for k, v in inputs.items() if k != "mm_token_type_ids"}).logits
    assert not torch.allclose(with_types[1, :lengths[1]], without[1, :lengths[1]], atol=1e-4)


def test_two_equal_frames_patchify_like_the_stock_image_processor(tmp_path, processor):
    """A still image is a video of two equal frames to Qwen: our video patchify must lay it out identically."""
    frame = np.random.default_rng(0).integers(0, 256, (56, 84, 3), dtype=np.uint8)
    from twinkle_core.data.vision_encode import MediaOptions

    patches, grid = processor.frames(np.stack([frame, frame]), MediaOptions(max_pixels=56 * 84))
    stock = processor.image_processor(images=[Image.fromarray(frame)], size={"shortest_edge": 56 * 56,
                                                                            "longest_edge": 56 * 84})
    assert grid == [1, 4, 6] and stock["image_grid_thw"].tolist() == [[1, 4, 6]]
    np.testing.assert_allclose(patches, np.asarray(stock["pixel_values"]), atol=1e-6)


def test_video_rows_encode_frames_grids_and_seconds_per_grid(tmp_path, processor):
    write_video(tmp_path / "clip.mp4", frames=8, fps=4)
    row = _row(tmp_path, "<video>What happens?", "Noise.", videos=["clip.mp4"])
    example = ROW_FORMAT.encode(processor, row, fps=2.0, max_frames=4)
    assert example["video_grid_thw"] == [[2, 4, 4]]  # 4 frames sampled, 2 per temporal patch
    assert example["mm_token_type_ids"].count(2) == 8 and example["pixel_values"] == []
    assert example["second_per_grid_ts"] == [pytest.approx(2 / (3 / 1.75))]
    batch = ROW_FORMAT.collate([example], pad_token_id=processor.tokenizer.pad_token_id)
    assert batch["pixel_values_videos"].shape == (32, 1176) and "pixel_values" not in batch
    model = tiny_qwen2_5_vl(processor.tokenizer)
    loss = model(**batch).loss
    assert torch.isfinite(loss)


def test_a_cut_never_splits_an_image(tmp_path, processor):
    write_image(tmp_path / "red.png")
    write_image(tmp_path / "blue.png", (0, 0, 255))
    row = _row(tmp_path, "<image> and <image>: which is red?", "The first.", images=["red.png", "blue.png"])
    example = ROW_FORMAT.encode(processor, row)
    second = [i for i, t in enumerate(example["mm_token_type_ids"]) if t == 1][4]  # the blue image's first token
    cut = ROW_FORMAT.truncate(example, second + 2)
    assert len(cut["input_ids"]) == second and cut["image_grid_thw"] == [[1, 4, 4]]
    assert len(cut["pixel_values"]) == 16 * 1176 and cut["mm_token_type_ids"].count(1) == 4
    assert ROW_FORMAT.count_tokens(cut)[1] == 0  # the reply is past the cut: tokenize_dataset drops the row


def test_tokenised_cache_keeps_pixels_and_grids(tmp_path, model_dir):
    write_image(tmp_path / "red.png")
    write_image(tmp_path / "noise.png", seed=3)
    rows = [{"messages": [{"role": "user", "content": "<image>Colour?"}, {"role": "assistant", "content": "Red."}],
             "images": ["red.png"]},
            {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]},
            {"messages": [{"role": "user", "content": [{"type": "image", "image": "noise.png"}]},
                          {"role": "assistant", "content": "Noise."}]}]
    data = tmp_path / "vl.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    dataset = tokenize_dataset(data, model_dir, kind="vision_chat", max_length=256)
    assert (dataset.num_rows, dataset.num_bad) == (3, 0)
    stored = load_tokenized(dataset)
    processor = ROW_FORMAT.load_encoder(qwen_vl_tokenizer(), model_dir)
    direct = [ROW_FORMAT.encode(processor, ROW_FORMAT.check(row, tmp_path)) for row in rows]
    pad = processor.tokenizer.pad_token_id
    from_cache, fresh = ROW_FORMAT.collate(stored, pad_token_id=pad), ROW_FORMAT.collate(direct, pad_token_id=pad)
    assert from_cache.keys() == fresh.keys() and "pixel_values" in from_cache
    for key in fresh:
        assert torch.equal(from_cache[key], fresh[key]), key


def test_internvl_images_become_tiles_and_context_tokens(tmp_path):
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil
    from vision_models import internvl_tokenizer, save_tiny_internvl

    model_dir = save_tiny_internvl(tmp_path / "internvl")
    processor = ROW_FORMAT.load_encoder(internvl_tokenizer(), model_dir)
    wide = write_image(tmp_path / "wide.png", size=(112, 56), seed=1)  # 2 tiles and a thumbnail
    write_image(tmp_path / "red.png")  # 1 tile, no thumbnail
    rows = [_row(tmp_path, images=["wide.png"]), _row(tmp_path, "<image>Is it red?", "Yes.", images=["red.png"])]
    examples = [ROW_FORMAT.encode(processor, row) for row in rows]
    tokenizer = processor.tokenizer
    assert examples[0]["image_rows"] == [3] and examples[1]["image_rows"] == [1]
    assert examples[0]["mm_token_type_ids"].count(1) == 3 * 4  # 4 context tokens per tile
    assert "<img>" + "<IMG_CONTEXT>" * 12 + "</img>What colour" in tokenizer.decode(examples[0]["input_ids"])
    trained = [t for t, label in zip(examples[1]["input_ids"], examples[1]["labels"]) if label != -100]
    assert tokenizer.decode(trained) == "Yes.<|im_end|>"
    stock = GotOcr2ImageProcessorPil(size={"height": 56, "width": 56}, max_patches=4, image_mean=[0.485, 0.456, 0.406],
                                     image_std=[0.229, 0.224, 0.225])(images=[Image.open(wide)], crop_to_patches=True)
    batch = ROW_FORMAT.collate(examples, pad_token_id=tokenizer.pad_token_id)
    assert batch["pixel_values"].shape == (4, 3, 56, 56) and "image_grid_thw" not in batch
    assert torch.equal(batch["pixel_values"][:3], torch.as_tensor(np.asarray(stock["pixel_values"])))
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(model_dir)
    assert torch.isfinite(model(**batch).loss)


def test_held_out_rows_become_image_prompts_for_generation(tmp_path, processor):
    from twinkle_core.data.vision_rows import content_list_messages, content_text

    write_image(tmp_path / "red.png")
    row = _row(tmp_path, "Look: <image>What colour?", images=["red.png"])
    prompt = content_list_messages(row)[:1]
    red = str((tmp_path / "red.png").resolve())
    assert prompt == [{"role": "user", "content": [{"type": "text", "text": "Look: "}, {"type": "image", "image": red},
                                                   {"type": "text", "text": "What colour?"}]}]
    assert content_text(prompt[0]["content"]) == "Look: [image] What colour?"
    example = ROW_FORMAT.prompt(processor, prompt)
    text = processor.tokenizer.decode(example["input_ids"])
    assert text.endswith("<|vision_end|>What colour?<|im_end|>\n<|im_start|>assistant\n")
    assert example["mm_token_type_ids"].count(1) == 4 and example["image_grid_thw"] == [[1, 4, 4]]


def test_qwen3_videos_take_the_video_config_and_the_pixel_budget_of_the_whole_clip(tmp_path):
    """As the stock Qwen3VLVideoProcessor: video_preprocessor_config.json's sizes, compared with frames x height
    x width (checked against it with torchvision in bench/check_video_processor.py); images keep their own."""
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize

    model_dir = save_tiny_qwen3_vl(tmp_path / "qwen3")
    config = json.loads((model_dir / "video_preprocessor_config.json").read_text())
    config["size"]["longest_edge"] = 2 * 64 * 64  # two 64x64 frames' worth for the whole clip
    (model_dir / "video_preprocessor_config.json").write_text(json.dumps(config))
    processor = ROW_FORMAT.load_encoder(AutoTokenizer.from_pretrained(model_dir), model_dir)
    frames = np.random.default_rng(0).integers(0, 256, (5, 64, 64, 3), dtype=np.uint8)
    pixels, grid = processor.frames(frames, MediaOptions())
    height, width = smart_resize(5, 64, 64, temporal_factor=2, factor=32, min_pixels=64 * 64, max_pixels=2 * 64 * 64)
    assert (height, width) == (32, 32) and grid == [3, 2, 2] and pixels.shape == (12, 3 * 2 * 16 * 16)
    image = processor.images([Image.fromarray(frames[0])], MediaOptions())
    assert image.extras["image_grid_thw"] == [[1, 4, 4]]  # 64x64 within the image limits
