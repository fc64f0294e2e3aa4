"""The Qwen2-VL / Qwen2.5-VL / Qwen3-VL / Qwen 3.5 processor: transformers' PIL image processor and our
video patchify.

The stock `Qwen2_5_VLProcessor` cannot be built without torchvision (its video processor needs it), so
images go through `Qwen2VLImageProcessorPil` (the checkpoint's resize, rescale and normalisation) and decoded
video frames through the same resize and normalisation, then `patchify_frames`, which lays them out as the
stock video processor does: frames in groups of `temporal_patch_size`, each merge window's patches adjacent.
Videos take the checkpoint's video_preprocessor_config.json where it has one (Qwen3-VL's video sizes and
normalisation differ from its images'), as the stock video processor does. A medium stands for
`<|vision_start|>`, one pad token per merged patch, `<|vision_end|>`. `bench/check_video_processor.py`
compares all of this with the stock video processors where torchvision imports.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from .vision_encode import IMAGE, VIDEO, MediaInputs, MediaOptions, read_preprocessor_config, register_vision_processor

VIDEO_CONFIG = "video_preprocessor_config.json"

QWEN_VL_TYPES = ("qwen2_vl", "qwen2_5_vl")
QWEN3_VL_TYPES = ("qwen3_vl", "qwen3_5")  # transformers 5.24 maps both to Qwen2VLImageProcessorPil too


def patchify_frames(clip: np.ndarray, patch: int, merge: int, temporal: int) -> tuple[np.ndarray, list[int]]:
    """[T, C, H, W] frames (T a multiple of `temporal`) -> patches [t*h*w, C*temporal*patch*patch], [t, h, w]."""
    frames, channels, height, width = clip.shape
    grid_t, grid_h, grid_w = frames // temporal, height // patch, width // patch
    patches = clip.reshape(grid_t, temporal, channels, grid_h // merge, merge, patch, grid_w // merge, merge, patch)
    patches = patches.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return patches.reshape(grid_t * grid_h * grid_w, channels * temporal * patch * patch), [grid_t, grid_h, grid_w]


class QwenVisionProcessor:
    """Tokenizer + PIL image processor of a Qwen2(.5)-VL checkpoint."""

    extra_keys = ("image_grid_thw", "video_grid_thw", "second_per_grid_ts")

    def __init__(self, tokenizer, image_processor, video_processor=None):
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        self.video_processor = video_processor or image_processor
        self.tokens = {IMAGE: "<|image_pad|>", VIDEO: "<|video_pad|>"}
        self.start, self.end = "<|vision_start|>", "<|vision_end|>"
        missing = [t for t in (*self.tokens.values(), self.start, self.end)
                   if tokenizer.convert_tokens_to_ids(t) in (None, tokenizer.unk_token_id)]
        if missing:
            raise ValueError(f"tokenizer {tokenizer.name_or_path!r} has no token(s) {missing}; a Qwen-VL tokenizer "
                             "carries them as special tokens")
        self.token_ids = {kind: tokenizer.convert_tokens_to_ids(token) for kind, token in self.tokens.items()}

    @property
    def merge(self) -> int:
        return self.image_processor.merge_size

    def _size(self, options: MediaOptions, processor=None) -> dict:
        size = dict((processor or self.image_processor).size)
        if options.min_pixels is not None:
            size["shortest_edge"] = options.min_pixels
        if options.max_pixels is not None:
            size["longest_edge"] = options.max_pixels
        return size

    def _text(self, kind: int, grid) -> str:
        return self.start + self.tokens[kind] * (int(np.prod(grid)) // self.merge ** 2) + self.end

    def images(self, images: list, options: MediaOptions) -> MediaInputs:
        """Patches [sum of t*h*w, C*T*P*P] of PIL images, with their grids."""
        out = self.image_processor(images=images, size=self._size(options))
        grids = np.asarray(out["image_grid_thw"], dtype=np.int64).tolist()
        return MediaInputs(np.asarray(out["pixel_values"], dtype=np.float32), [int(np.prod(g)) for g in grids],
                           [self._text(IMAGE, g) for g in grids], {"image_grid_thw": grids})

    def videos(self, videos: list, options: MediaOptions) -> MediaInputs:
        patches, grids, seconds = [], [], []
        for video in videos:
            pixels, grid = self.frames(video.frames, options)
            patches.append(pixels)
            grids.append(grid)
            seconds.append(self.video_processor.temporal_patch_size / video.sampled_fps)
        return MediaInputs(np.concatenate(patches), [int(np.prod(g)) for g in grids],
                           [self._video_text(g, video) for g, video in zip(grids, videos)],
                           {"video_grid_thw": grids, "second_per_grid_ts": seconds})

    def _video_text(self, grid: list[int], video) -> str:
        """Qwen2(.5)-VL: one run of pad tokens for the whole video (its times ride on second_per_grid_ts)."""
        return self._text(VIDEO, grid)

    def clip_size(self, frames: np.ndarray, size: dict) -> tuple[int, int] | None:
        """One (height, width) for every frame of a clip, or None: Qwen2(.5)-VL sizes each frame as an image."""
        return None

    def frames(self, frames: np.ndarray, options: MediaOptions) -> tuple[np.ndarray, list[int]]:
        """Patches and grid of one video's frames [T, H, W, 3], in the stock video processor's layout."""
        from transformers.image_processing_backends import PilBackend
        from transformers.image_utils import SizeDict

        proc = self.video_processor
        patch, temporal = proc.patch_size, proc.temporal_patch_size
        size = self._size(options, proc)
        fixed = self.clip_size(frames, size)
        prepared = []
        for frame in frames:
            image = proc.process_image(frame)
            if fixed is None:
                image = proc.resize(image, size=SizeDict(**size), resample=proc.resample, factor=patch * self.merge)
            else:  # the plain resize to a given size (Qwen2VLImageProcessorPil.resize would smart-resize again)
                image = PilBackend.resize(proc, image, SizeDict(height=fixed[0], width=fixed[1]), resample=proc.resample)
            image = proc.normalize(proc.rescale(image, proc.rescale_factor), proc.image_mean, proc.image_std)
            prepared.append(np.asarray(image, dtype=np.float32))
        clip = np.stack(prepared)  # [T, C, H, W]
        if len(clip) % temporal:  # the last group is filled with copies of the last frame
            clip = np.concatenate([clip, np.repeat(clip[-1:], temporal - len(clip) % temporal, axis=0)])
        return patchify_frames(clip, patch, self.merge, temporal)


class Qwen3VisionProcessor(QwenVisionProcessor):
    """Qwen3-VL and Qwen 3.5 (with its vision tower): the same PIL image processor and patchify (their
    checkpoints use patch 16), but a video is written frame group by frame group, each behind its timestamp,
    as the stock `Qwen3VLProcessor` writes it: `<0.5 seconds><|vision_start|><|video_pad|>...<|vision_end|>`.
    Their rope index splits `video_grid_thw` into one grid per frame group to match. The timestamp of a group
    is the mean time of its first and last frame (their presentation times; else frame i at i / sampled_fps),
    and the copies of the last frame that fill the last group count at that frame's time.
    A clip's frames share one size, from the pixel budget of the whole clip (frames x height x width against
    min / max pixels), as the stock Qwen3-VL video processor sizes them."""

    def clip_size(self, frames: np.ndarray, size: dict) -> tuple[int, int]:
        from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize

        proc = self.video_processor
        # a clip shorter than one frame group is filled up to it, so it is sized as one group
        return smart_resize(max(len(frames), proc.temporal_patch_size), frames.shape[1], frames.shape[2],
                            temporal_factor=proc.temporal_patch_size, factor=proc.patch_size * self.merge,
                            min_pixels=size["shortest_edge"], max_pixels=size["longest_edge"])

    def _video_text(self, grid: list[int], video) -> str:
        temporal, last = self.video_processor.temporal_patch_size, len(video.frames) - 1
        times = video.times or tuple(i / video.sampled_fps for i in range(last + 1))
        per_group = grid[1] * grid[2] // self.merge ** 2
        text = ""
        for group in range(grid[0]):
            first = group * temporal
            time = (times[first] + times[min(first + temporal - 1, last)]) / 2
            text += f"<{time:.1f} seconds>" + self.start + self.tokens[VIDEO] * per_group + self.end
        return text


def load_qwen_vision_processor(tokenizer, model_dir: Path, config: dict) -> QwenVisionProcessor:
    """Its preprocessor_config.json, else the config's vision settings with the image processor's defaults;
    for videos its video_preprocessor_config.json over those, where it has one."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    vision = config.get("vision_config") or {}
    settings = {key: vision[key] for key in ("patch_size", "temporal_patch_size") if key in vision}
    if "spatial_merge_size" in vision:
        settings["merge_size"] = vision["spatial_merge_size"]
    keys = ("patch_size", "temporal_patch_size", "merge_size", "min_pixels", "max_pixels", "image_mean", "image_std",
            "size")
    image = {**settings, **read_preprocessor_config(model_dir, keys)}
    video = read_preprocessor_config(model_dir, keys, VIDEO_CONFIG)
    cls = Qwen3VisionProcessor if config.get("model_type") in QWEN3_VL_TYPES else QwenVisionProcessor
    return cls(tokenizer, Qwen2VLImageProcessorPil(**image),
               Qwen2VLImageProcessorPil(**{**image, **video}) if video else None)


register_vision_processor(QWEN_VL_TYPES + QWEN3_VL_TYPES, load_qwen_vision_processor)
