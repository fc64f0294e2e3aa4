"""Encode vision-language rows for Qwen2-VL / Qwen2.5-VL: image and video tokens, pixel patches, grids.

The stock `Qwen2_5_VLProcessor` cannot be built without torchvision (its video processor needs it), so
this module puts transformers' PIL image processor (`Qwen2VLImageProcessorPil`, the model's own resize,
rescale and normalisation) behind a small processor of ours, and patchifies decoded video frames itself in
the layout of the stock video processor: frames in groups of `temporal_patch_size`, each merge window's
patches adjacent.

Each `<image>` / `<video>` placeholder becomes `<|vision_start|>` + one pad token per merged patch +
`<|vision_end|>` before the chat is rendered, so the chat template and the label masking see ordinary
text and the labels stay on the assistant's replies. `mm_token_type_ids` (0 text, 1 image, 2 video) tell
the model where the media tokens are; without it Qwen2.5-VL falls back to 1-D positions silently.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .encode import encode_chat
from .errors import RowError
from .media import open_image, read_video
from .vision_rows import PLACEHOLDERS

TEXT, IMAGE, VIDEO = 0, 1, 2  # mm_token_type_ids
QWEN_VL_TYPES = ("qwen2_vl", "qwen2_5_vl")


@dataclass(frozen=True)
class MediaOptions:
    """How media are sized and sampled (None: the checkpoint's preprocessor setting)."""

    min_pixels: int | None = None
    max_pixels: int | None = None
    fps: float = 2.0  # video frames sampled per second
    max_frames: int = 64  # at most this many frames per video
    video_max_pixels: int | None = None  # per frame (None: max_pixels)


class QwenVisionProcessor:
    """Tokenizer + PIL image processor of a Qwen2(.5)-VL checkpoint: what `encode_vision_row` takes."""

    def __init__(self, tokenizer, image_processor, tokens_per_second: float | None = None):
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        self.tokens_per_second = tokens_per_second
        self.image_token, self.video_token = "<|image_pad|>", "<|video_pad|>"
        self.start, self.end = "<|vision_start|>", "<|vision_end|>"
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
        self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
        missing = [t for t in (self.image_token, self.video_token, self.start, self.end)
                   if tokenizer.convert_tokens_to_ids(t) in (None, tokenizer.unk_token_id)]
        if missing:
            raise ValueError(f"tokenizer {tokenizer.name_or_path!r} has no token(s) {missing}; a Qwen-VL tokenizer "
                             "carries them as special tokens")

    @property
    def merge(self) -> int:
        return self.image_processor.merge_size

    def _size(self, min_pixels: int | None, max_pixels: int | None) -> dict:
        size = dict(self.image_processor.size)
        if min_pixels is not None:
            size["shortest_edge"] = min_pixels
        if max_pixels is not None:
            size["longest_edge"] = max_pixels
        return size

    def images(self, images: list, options: MediaOptions) -> tuple[np.ndarray, np.ndarray]:
        """Patches [sum of t*h*w, C*T*P*P] and grids [n, 3] of PIL images."""
        out = self.image_processor(images=images, size=self._size(options.min_pixels, options.max_pixels))
        return np.asarray(out["pixel_values"], dtype=np.float32), np.asarray(out["image_grid_thw"], dtype=np.int64)

    def video(self, frames: np.ndarray, options: MediaOptions) -> tuple[np.ndarray, list[int]]:
        """Patches and grid of one video's frames [T, H, W, 3], in the stock video processor's layout."""
        from transformers.image_utils import SizeDict

        proc = self.image_processor
        patch, temporal = proc.patch_size, proc.temporal_patch_size
        size = SizeDict(**self._size(options.min_pixels, options.video_max_pixels or options.max_pixels))
        prepared = []
        for frame in frames:
            image = proc.process_image(frame)  # [C, H, W]
            image = proc.resize(image, size=size, resample=proc.resample, factor=patch * self.merge)
            image = proc.normalize(proc.rescale(image, proc.rescale_factor), proc.image_mean, proc.image_std)
            prepared.append(np.asarray(image, dtype=np.float32))
        clip = np.stack(prepared)  # [T, C, H, W]
        if len(clip) % temporal:  # the last group is filled with copies of the last frame
            clip = np.concatenate([clip, np.repeat(clip[-1:], temporal - len(clip) % temporal, axis=0)])
        return patchify_frames(clip, patch, self.merge, temporal)


def patchify_frames(clip: np.ndarray, patch: int, merge: int, temporal: int) -> tuple[np.ndarray, list[int]]:
    """[T, C, H, W] frames (T a multiple of `temporal`) -> patches [t*h*w, C*temporal*patch*patch], [t, h, w]."""
    frames, channels, height, width = clip.shape
    grid_t, grid_h, grid_w = frames // temporal, height // patch, width // patch
    patches = clip.reshape(grid_t, temporal, channels, grid_h // merge, merge, patch, grid_w // merge, merge, patch)
    patches = patches.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return patches.reshape(grid_t * grid_h * grid_w, channels * temporal * patch * patch), [grid_t, grid_h, grid_w]


def load_vision_processor(tokenizer, model_dir: Path) -> QwenVisionProcessor:
    """The processor of a downloaded vision-language directory (Qwen2(.5)-VL so far): its
    preprocessor_config.json, else the config's vision settings with the image processor's defaults."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    config = json.loads((model_dir / "config.json").read_text())
    if config.get("model_type") not in QWEN_VL_TYPES:
        raise ValueError(f"{model_dir}: model_type {config.get('model_type')!r} has no vision encoder here yet; "
                         f"vision rows encode for {', '.join(QWEN_VL_TYPES)}")
    vision = config.get("vision_config") or {}
    settings = {key: vision[key] for key in ("patch_size", "temporal_patch_size") if key in vision}
    if "spatial_merge_size" in vision:
        settings["merge_size"] = vision["spatial_merge_size"]
    preprocessor = model_dir / "preprocessor_config.json"
    if preprocessor.is_file():
        saved = json.loads(preprocessor.read_text())
        keys = ("patch_size", "temporal_patch_size", "merge_size", "min_pixels", "max_pixels", "image_mean",
                "image_std", "size")
        settings.update({key: saved[key] for key in keys if key in saved})
    return QwenVisionProcessor(tokenizer, Qwen2VLImageProcessorPil(**settings), vision.get("tokens_per_second"))


def _media_text(processor: QwenVisionProcessor, token: str, grid) -> str:
    count = int(np.prod(grid)) // processor.merge ** 2
    return processor.start + token * count + processor.end


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


def encode_vision_row(processor: QwenVisionProcessor, row: dict, enable_thinking: bool = True,
                      **options) -> dict:
    """Token ids, labels (assistant replies only), mm_token_type_ids, and the pixel patches with their grids
    (flat float lists; `image_grid_thw` / `video_grid_thw` give their shapes)."""
    media = MediaOptions(**options)
    messages = row["messages"]
    # Every example has every key (empty without that medium): the tokenised cache stores one column per key.
    example: dict = {"pixel_values": [], "image_grid_thw": [], "pixel_values_videos": [], "video_grid_thw": [],
                     "second_per_grid_ts": []}
    if row.get("images"):
        pixels, grids = processor.images([open_image(ref, f"images[{i}]") for i, ref in enumerate(row["images"])], media)
        texts = [_media_text(processor, processor.image_token, grid) for grid in grids]
        messages = _fill_placeholders(messages, PLACEHOLDERS["image"], texts)
        example.update(pixel_values=pixels.reshape(-1).tolist(), image_grid_thw=grids.tolist())
    if row.get("videos"):
        patches, grids, seconds = [], [], []
        for index, ref in enumerate(row["videos"]):
            video = read_video(ref, media.fps, media.max_frames, f"videos[{index}]")
            pixels, grid = processor.video(video.frames, media)
            patches.append(pixels)
            grids.append(grid)
            seconds.append(processor.image_processor.temporal_patch_size / video.sampled_fps)
        texts = [_media_text(processor, processor.video_token, grid) for grid in grids]
        messages = _fill_placeholders(messages, PLACEHOLDERS["video"], texts)
        example.update(pixel_values_videos=np.concatenate(patches).reshape(-1).tolist(), video_grid_thw=grids,
                       second_per_grid_ts=seconds)
    encoded = encode_chat(processor.tokenizer, messages, tools=row.get("tools"), enable_thinking=enable_thinking)
    ids = encoded["input_ids"]
    types = [IMAGE if t == processor.image_token_id else VIDEO if t == processor.video_token_id else TEXT for t in ids]
    for kind, key in ((IMAGE, "image_grid_thw"), (VIDEO, "video_grid_thw")):
        expected = sum(int(np.prod(grid)) // processor.merge ** 2 for grid in example.get(key, []))
        if types.count(kind) != expected:  # e.g. a user who typed <|image_pad|> into the text
            raise RowError(f"the rendered row holds {types.count(kind)} {'image' if kind == IMAGE else 'video'} "
                           f"tokens where its media need {expected}; a message's text contains the model's own "
                           "media tokens")
    return {**encoded, "mm_token_type_ids": types, **example}
