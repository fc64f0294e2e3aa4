"""Encode vision-language rows with a family's processor: media tokens, labels on the replies, pixel data.

A processor (twinkle_core.data.qwen_vision, twinkle_core.data.internvl_vision) turns a row's images and
videos into `MediaInputs`: pixel rows, the text each medium stands for in the conversation (its start
token, one token per visual feature, its end token) and per-medium extras the model needs (Qwen's grids).
Each `<image>` / `<video>` placeholder is replaced by that text before the chat is rendered, so the chat
template and the label masking see ordinary text and the labels stay on the assistant's replies.
`mm_token_type_ids` (0 text, 1 image, 2 video) mark the media tokens: Qwen's 3-D positions need them, and a
cut at max_length uses them to never split a medium (twinkle_core.data.vision_collate).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from .encode import encode_chat
from .errors import RowError
from .media import open_image, read_video
from .vision_rows import PLACEHOLDERS

TEXT, IMAGE, VIDEO = 0, 1, 2  # mm_token_type_ids
MEDIA_KEYS = {IMAGE: ("pixel_values", "image_rows", "image_shape"),
              VIDEO: ("pixel_values_videos", "video_rows", "video_shape")}


@dataclass(frozen=True)
class MediaOptions:
    """How media are sized and sampled (None: the checkpoint's preprocessor setting)."""

    min_pixels: int | None = None
    max_pixels: int | None = None
    fps: float = 2.0  # video frames sampled per second
    max_frames: int = 64  # at most this many frames per video


@dataclass
class MediaInputs:
    """A row's images (or videos): pixel rows [n, ...], the rows of each medium, the text each stands for,
    and the model's per-medium extras (e.g. image_grid_thw)."""

    pixels: np.ndarray
    rows: list[int]
    texts: list[str]
    extras: dict[str, list] = field(default_factory=dict)


_PROCESSORS: dict[str, Callable] = {}  # model_type -> (tokenizer, model_dir, config) -> processor


def register_vision_processor(model_types: tuple[str, ...], load: Callable) -> None:
    """Name the loader of the processor for these model types; a model type is claimed once."""
    for model_type in model_types:
        if model_type in _PROCESSORS:
            raise ValueError(f"model_type {model_type!r} already has a vision processor")
        _PROCESSORS[model_type] = load


def load_vision_processor(tokenizer, model_dir: Path):
    """The processor of a downloaded vision-language directory, by its config.json model_type."""
    from . import internvl_vision, qwen_vision  # noqa: F401  (they register their model types)

    config = json.loads((model_dir / "config.json").read_text())
    model_type = config.get("model_type")
    if model_type not in _PROCESSORS:
        raise ValueError(f"{model_dir}: model_type {model_type!r} has no vision encoder here yet; vision rows "
                         f"encode for {', '.join(sorted(_PROCESSORS))}")
    return _PROCESSORS[model_type](tokenizer, model_dir, config)


def read_preprocessor_config(model_dir: Path, keys: tuple[str, ...], name: str = "preprocessor_config.json") -> dict:
    """The listed settings of a checkpoint's preprocessor_config.json, or of `name` (empty without one)."""
    path = model_dir / name
    saved = json.loads(path.read_text()) if path.is_file() else {}
    return {key: saved[key] for key in keys if key in saved}


def _fill_placeholders(messages: list[dict], placeholder: str, texts: list[str]) -> list[dict]:
    """Replace the placeholders, in order over the conversation, with each medium's token text."""
    pending = iter(texts)
    out = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, str) and placeholder in content:
            pieces = content.split(placeholder)
            content = pieces[0] + "".join(next(pending) + piece for piece in pieces[1:])
            message = {**message, "content": content}
        out.append(message)
    return out


def _media(processor, row: dict, media: MediaOptions) -> dict[int, MediaInputs]:
    found = {}
    if row.get("images"):
        images = [open_image(ref, f"images[{i}]") for i, ref in enumerate(row["images"])]
        found[IMAGE] = processor.images(images, media)
    if row.get("videos"):
        videos = [read_video(ref, media.fps, media.max_frames, f"videos[{i}]") for i, ref in enumerate(row["videos"])]
        found[VIDEO] = processor.videos(videos, media)
    return found


def _with_media(processor, row: dict, options: dict) -> tuple[list[dict], dict, dict[int, MediaInputs]]:
    """The row's messages with each placeholder replaced by its medium's tokens, the example's media keys,
    and the media."""
    found = _media(processor, row, MediaOptions(**options))
    # Every example has every key (empty without that medium): the tokenised cache stores one column per key.
    example: dict = {key: [] for keys in MEDIA_KEYS.values() for key in keys}
    example.update({key: [] for key in processor.extra_keys})
    messages = row["messages"]
    for kind, inputs in found.items():
        pixels_key, rows_key, shape_key = MEDIA_KEYS[kind]
        messages = _fill_placeholders(messages, PLACEHOLDERS["image" if kind == IMAGE else "video"], inputs.texts)
        example.update({pixels_key: inputs.pixels.reshape(-1).tolist(), rows_key: inputs.rows,
                        shape_key: list(inputs.pixels.shape[1:]), **inputs.extras})
    return messages, example, found


def _token_types(processor, ids: list[int], found: dict[int, MediaInputs]) -> list[int]:
    """mm_token_type_ids of `ids`, checked against the media tokens the media need."""
    token_kind = {processor.token_ids[kind]: kind for kind in processor.tokens}
    types = [token_kind.get(token, TEXT) for token in ids]
    for kind, token in processor.tokens.items():
        expected = sum(text.count(token) for text in found[kind].texts) if kind in found else 0
        if types.count(kind) != expected:  # e.g. a user who typed the model's media token into the text
            raise RowError(f"the rendered row holds {types.count(kind)} {token} tokens where its media need "
                           f"{expected}; a message's text contains the model's own media tokens")
    return types


def encode_vision_row(processor, row: dict, enable_thinking: bool = True, **options) -> dict:
    """Token ids, labels (assistant replies only), mm_token_type_ids, and per medium its flat pixel rows,
    the rows of each medium, their trailing shape, and the processor's extras."""
    messages, example, found = _with_media(processor, row, options)
    encoded = encode_chat(processor.tokenizer, messages, tools=row.get("tools"), enable_thinking=enable_thinking)
    return {**encoded, "mm_token_type_ids": _token_types(processor, encoded["input_ids"], found), **example}


def encode_vision_prompt(processor, messages: list[dict], enable_thinking: bool = True, **options) -> dict:
    """An example of a conversation that ends with a user turn, up to the assistant header, for generation
    (its labels are its ids; nothing trains on them). Media references are absolute, pkg:// or base64."""
    from .templates import render_chat
    from .vision_rows import validate_vision_row

    # Validated as a chat with a stand-in reply, so a prompt without assistant turns passes.
    row = validate_vision_row({"messages": list(messages) + [{"role": "assistant", "content": "-"}]})
    row["messages"] = row["messages"][:-1]
    prompt, example, found = _with_media(processor, row, options)
    text = render_chat(processor.tokenizer, prompt, add_generation_prompt=True, enable_thinking=enable_thinking)
    ids = list(processor.tokenizer(text, add_special_tokens=False)["input_ids"])
    return {"input_ids": ids, "labels": ids, "mm_token_type_ids": _token_types(processor, ids, found), **example}
