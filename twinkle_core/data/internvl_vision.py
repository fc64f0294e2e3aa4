"""The InternVL processor (transformers' native `internvl` checkpoints): 448-pixel tiles, images only.

`GotOcr2ImageProcessorPil` cuts each image into up to `max_patches` tiles of the model's size (plus a
thumbnail of the whole image when there is more than one tile), as the stock `InternVLProcessor` does with
crop_to_patches; the stock processor is not built because it needs torchvision for its video part. An image
stands for `<img>`, `image_seq_length` context tokens per tile, `</img>`.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from .errors import RowError
from .vision_encode import IMAGE, MediaInputs, MediaOptions, read_preprocessor_config, register_vision_processor


class InternVLVisionProcessor:
    """Tokenizer + tiling image processor of an InternVL checkpoint."""

    extra_keys = ()

    def __init__(self, tokenizer, image_processor, tokens_per_tile: int):
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        self.tokens_per_tile = tokens_per_tile
        self.tokens = {IMAGE: "<IMG_CONTEXT>"}
        self.start, self.end = "<img>", "</img>"
        missing = [t for t in (self.tokens[IMAGE], self.start, self.end)
                   if tokenizer.convert_tokens_to_ids(t) in (None, tokenizer.unk_token_id)]
        if missing:
            raise ValueError(f"tokenizer {tokenizer.name_or_path!r} has no token(s) {missing}; an InternVL tokenizer "
                             "carries them as special tokens")
        self.token_ids = {IMAGE: tokenizer.convert_tokens_to_ids(self.tokens[IMAGE])}

    def images(self, images: list, options: MediaOptions) -> MediaInputs:
        """Tiles [sum of tiles, 3, H, W]; each image's tile count (its thumbnail included)."""
        out = self.image_processor(images=images, crop_to_patches=True)
        tiles = [int(n) for n in np.asarray(out["num_patches"]).reshape(-1)]
        texts = [self.start + self.tokens[IMAGE] * (self.tokens_per_tile * n) + self.end for n in tiles]
        return MediaInputs(np.asarray(out["pixel_values"], dtype=np.float32), tiles, texts)

    def videos(self, videos: list, options: MediaOptions) -> MediaInputs:
        raise RowError("videos: InternVL 2.5 rows carry images only")


def load_internvl_processor(tokenizer, model_dir: Path, config: dict) -> InternVLVisionProcessor:
    """Tile size from the vision config, tile counts and normalisation from preprocessor_config.json."""
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

    vision = config.get("vision_config") or {}
    side, patch = _pair(vision.get("image_size", 448)), _pair(vision.get("patch_size", 14))
    ratio = config.get("downsample_ratio", 0.5)
    per_tile = config.get("image_seq_length") or int((side[0] // patch[0]) * (side[1] // patch[1]) * ratio ** 2)
    settings = {"size": {"height": side[0], "width": side[1]}, "min_patches": 1, "max_patches": 12,
                "image_mean": [0.485, 0.456, 0.406], "image_std": [0.229, 0.224, 0.225]}
    settings.update(read_preprocessor_config(model_dir, ("size", "min_patches", "max_patches", "image_mean",
                                                         "image_std")))
    return InternVLVisionProcessor(tokenizer, GotOcr2ImageProcessorPil(**settings), per_tile)


def _pair(value) -> tuple[int, int]:
    return (value, value) if isinstance(value, int) else (int(value[0]), int(value[1]))


register_vision_processor(("internvl",), load_internvl_processor)
