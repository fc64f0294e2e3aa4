"""Tiny vision-language checkpoints and media files built inside the tests (no hub, a few seconds each)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from transformers import AutoConfig, GenerationConfig, InternVLForConditionalGeneration, Qwen2_5_VLForConditionalGeneration

from family_models import family_tokenizer
from tiny_models import make_tiny_tokenizer
from twinkle_core.data import get_chat_template

PATCH, MERGE = 14, 2
PIXELS = (56 * 56, 56 * 56)  # min/max pixels: a 56x56 image is 4x4 patches, 4 merged tokens


def write_image(path: Path, colour=(255, 0, 0), size=(56, 56), seed: int | None = None) -> Path:
    """A PNG of one colour, or random pixels with `seed`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if seed is None:
        Image.new("RGB", size, colour).save(path)
    else:
        pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
        Image.fromarray(pixels).save(path)
    return path


def write_video(path: Path, frames: int = 8, fps: int = 4, size=(56, 56), seed: int = 0) -> Path:
    """A short MPEG-4 video of random frames (PyAV)."""
    import av

    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = size[0], size[1], "yuv420p"
        for _ in range(frames):
            pixels = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
            container.mux(stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")))
        container.mux(stream.encode())
    return path


def qwen_vl_tokenizer():
    """The Qwen 2.5 tiny tokenizer (it has the vision tokens) with the Qwen 2.5 chat template."""
    return family_tokenizer("qwen2_5", get_chat_template("qwen2_5"))


def tiny_qwen2_5_vl(tokenizer, seed: int = 0) -> Qwen2_5_VLForConditionalGeneration:
    """A random Qwen2.5-VL of the real class: 2 text layers (hidden 64), a 1-block vision tower, real M-RoPE."""
    tid = tokenizer.convert_tokens_to_ids
    config = AutoConfig.for_model(
        "qwen2_5_vl",
        text_config=dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                         bos_token_id=tid("<|endoftext|>"), eos_token_id=tid("<|im_end|>"),
                         pad_token_id=tid("<|endoftext|>"),
                         rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0,
                                          "mrope_section": [2, 3, 3]}),  # head_dim 16: 8 rotary pairs
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                           patch_size=PATCH, spatial_merge_size=MERGE, temporal_patch_size=2, window_size=56,
                           fullatt_block_indexes=[0], tokens_per_second=2),
        image_token_id=tid("<|image_pad|>"), video_token_id=tid("<|video_pad|>"),
        vision_start_token_id=tid("<|vision_start|>"), vision_end_token_id=tid("<|vision_end|>"),
    )
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(config)
    model.generation_config = GenerationConfig(eos_token_id=[tid("<|im_end|>")], pad_token_id=tid("<|endoftext|>"))
    return model


def save_tiny_qwen2_5_vl(directory: Path, seed: int = 0) -> Path:
    """A downloaded-looking Qwen2.5-VL directory: config, safetensors, tokenizer, preprocessor_config.json."""
    tokenizer = qwen_vl_tokenizer()
    tiny_qwen2_5_vl(tokenizer, seed).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    (Path(directory) / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Qwen2VLImageProcessor", "patch_size": PATCH, "merge_size": MERGE,
        "temporal_patch_size": 2, "min_pixels": PIXELS[0], "max_pixels": PIXELS[1],
        "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711]}))
    return Path(directory)


INTERNVL_TOKENS = ["<img>", "</img>", "<IMG_CONTEXT>"]
TILE = 56  # a tile is 4x4 patches of 14, pixel-shuffled to 2x2: 4 context tokens per tile


def internvl_tokenizer():
    """A ChatML tokenizer with InternVL's image tokens."""
    return make_tiny_tokenizer(extra_special_tokens=INTERNVL_TOKENS)


def save_tiny_internvl(directory: Path, seed: int = 0) -> Path:
    """A transformers-native InternVL directory: a 2-layer Qwen2 language model, a 1-layer InternViT, 56-pixel
    tiles (at most 4 and a thumbnail), preprocessor_config.json."""
    tokenizer = internvl_tokenizer()
    tid = tokenizer.convert_tokens_to_ids
    config = AutoConfig.for_model(
        "internvl",
        text_config=dict(model_type="qwen2", vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           image_size=TILE, patch_size=PATCH),
        image_token_id=tid("<IMG_CONTEXT>"), image_seq_length=4, downsample_ratio=0.5)
    torch.manual_seed(seed)
    InternVLForConditionalGeneration(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    (Path(directory) / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "GotOcr2ImageProcessor", "size": {"height": TILE, "width": TILE},
        "crop_to_patches": True, "min_patches": 1, "max_patches": 4}))
    return Path(directory)


PATCH3 = 16  # Qwen3-VL and Qwen 3.5 checkpoints use 16-pixel patches: a 64x64 image is 4x4 patches, 4 tokens
PIXELS3 = (64 * 64, 64 * 64)


def _qwen3_preprocessor(directory: Path) -> None:
    (Path(directory) / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Qwen2VLImageProcessor", "patch_size": PATCH3, "merge_size": MERGE,
        "temporal_patch_size": 2, "size": {"shortest_edge": PIXELS3[0], "longest_edge": PIXELS3[1]},
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}))


def save_tiny_qwen3_vl(directory: Path, seed: int = 0) -> Path:
    """A Qwen3-VL directory of the real class: 2 text layers (hidden 64, head 16, interleaved M-RoPE), a 1-block
    vision tower with one DeepStack merger, 16-pixel patches, preprocessor_config.json."""
    from transformers import Qwen3VLForConditionalGeneration

    tokenizer = family_tokenizer("qwen3", get_chat_template("chatml"))
    tid = tokenizer.convert_tokens_to_ids
    config = AutoConfig.for_model(
        "qwen3_vl",
        text_config=dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False,
                         bos_token_id=tid("<|endoftext|>"), eos_token_id=tid("<|im_end|>"),
                         pad_token_id=tid("<|endoftext|>"),
                         rope_parameters={"rope_type": "default", "rope_theta": 5_000_000.0,
                                          "mrope_section": [4, 2, 2], "mrope_interleaved": True}),
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                           patch_size=PATCH3, spatial_merge_size=MERGE, temporal_patch_size=2,
                           num_position_embeddings=64, deepstack_visual_indexes=[0]),
        image_token_id=tid("<|image_pad|>"), video_token_id=tid("<|video_pad|>"),
        vision_start_token_id=tid("<|vision_start|>"), vision_end_token_id=tid("<|vision_end|>"),
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = Qwen3VLForConditionalGeneration(config)
    model.generation_config = GenerationConfig(eos_token_id=[tid("<|im_end|>")], pad_token_id=tid("<|endoftext|>"))
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    _qwen3_preprocessor(directory)
    return Path(directory)


def save_tiny_qwen3_5_vl(directory: Path) -> Path:
    """The tiny top-level `qwen3_5` checkpoint of the Qwen 3.5 family tests (gated-delta-net + gated attention
    layers, a 1-block vision tower), with a preprocessor_config.json: the Qwen 3.5 VL model of that checkpoint."""
    from family_models import save_tiny_family_model

    save_tiny_family_model("qwen3_5", directory)
    _qwen3_preprocessor(directory)
    return Path(directory)
