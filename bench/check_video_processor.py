"""One-off check: our Qwen video encoding (twinkle_core.data.qwen_vision) against transformers' stock
`Qwen2VLVideoProcessor` (Qwen2.5-VL) and `Qwen3VLVideoProcessor` (Qwen3-VL).

The stock video processors need torchvision, which the project's venv does not have, so run this from a
separate venv that has torch + torchvision + transformers 5.24.0 + av, with the repo on PYTHONPATH:

    cd /work/main && PYTHONPATH=/work/main /tmp/tvenv/bin/python bench/check_video_processor.py

It writes a few short MPEG-4 videos (PyAV: moving shapes, sizes 56x56 .. 96x64, odd frame counts, 4-10 fps)
into a temporary folder, decodes and samples them with twinkle_core.data.media.read_video, and checks:

1. patchify (hard check): the SAME sampled frames through our `frames()` and the stock processor
   (do_sample_frames=False), with the same sizes / mean / std / patch / merge / temporal settings.
   Sizes that need no resize must match exactly (tolerance 0 on uint8 inputs: we allow 1e-6 for float
   rounding of the fused rescale+normalise); sizes that need a resize go through PIL bicubic (ours) and
   torchvision bicubic antialias (stock): allowed max abs difference RESIZE_TOL (a few uint8 steps after
   normalisation), mean abs difference RESIZE_MEAN_TOL. Grids must be equal.
2. Qwen3-VL timestamps (hard check): the `<t seconds>` of each frame group in our prompt text against
   `Qwen3VLProcessor._calculate_timestamps` on the same frame indices.
3. sizing with the checkpoints' own configs (reported; fails only with --strict): our video sizing uses the
   image processor's preprocessor_config.json sizes with the per-frame smart_resize, the stock one its
   video_preprocessor_config.json and, for Qwen3-VL, a smart_resize over frames * height * width.
4. frame sampling at fps=2 (reported; fails only with --strict): our read_video picks against the stock
   processor's sample_frames on the full decoded clip.
5. the proposed Qwen3-VL sizing fix, simulated here (hard check): a Qwen3VisionProcessor built from the
   video config whose frames() sizes with the Qwen3-VL video smart_resize over (frames, H, W), against
   the stock processor with that config, on videos small enough to be upscaled by the image config.
"""
from __future__ import annotations

import argparse
import re
import sys
import tempfile
import warnings
from pathlib import Path

import numpy as np

warnings.filterwarnings("ignore")

EXACT_TOL = 1e-6
RESIZE_TOL = 0.1  # max abs; one uint8 step is 1/255/std = 0.0146 (CLIP std) or 0.0078 (std 0.5)
RESIZE_MEAN_TOL = 0.01

# Tiny videos: (name, width, height, frames, fps)
VIDEOS = [
    ("v56x56_9f_4fps", 56, 56, 9, 4),
    ("v64x48_7f_6fps", 64, 48, 7, 6),
    ("v64x64_5f_5fps", 64, 64, 5, 5),
    ("v84x56_15f_10fps", 84, 56, 15, 10),
    ("v96x64_11f_8fps", 96, 64, 11, 8),
]

CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]
# Settings as in the checkpoints (Qwen2.5-VL: preprocessor_config.json, used for video too as it has no
# video_preprocessor_config.json; Qwen3-VL: preprocessor_config.json for images, video_preprocessor_config.json
# for videos). The Qwen3-VL numbers are the published Qwen3-VL-*-Instruct configs as we recall them (no hub
# access here to re-read them): image size 65536..16777216 pixels per image, video 4096..25165824 pixels per
# clip (the stock Qwen3-VL video smart_resize compares frames * height * width with them).
QWEN25 = dict(patch_size=14, temporal_patch_size=2, merge_size=2, image_mean=CLIP_MEAN, image_std=CLIP_STD,
              size={"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 16384})  # min_pixels 3136, max 12845056
QWEN3_IMAGE = dict(patch_size=16, temporal_patch_size=2, merge_size=2, image_mean=[0.5] * 3, image_std=[0.5] * 3,
                   size={"shortest_edge": 65536, "longest_edge": 16777216})
QWEN3_VIDEO = dict(patch_size=16, temporal_patch_size=2, merge_size=2, image_mean=[0.5] * 3, image_std=[0.5] * 3,
                   size={"shortest_edge": 4096, "longest_edge": 25165824})
QWEN3_TIGHT = {**QWEN3_VIDEO, "size": {"shortest_edge": 8192, "longest_edge": 16384}}  # pixels over T*H*W (stock)


def write_video(path: Path, width: int, height: int, frames: int, fps: int) -> Path:
    """A gradient background with a moving square and a moving disc (MPEG-4, yuv420p)."""
    import av

    yy, xx = np.mgrid[0:height, 0:width]
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for i in range(frames):
            img = np.zeros((height, width, 3), np.uint8)
            img[..., 0] = (xx * 255 // max(1, width - 1)).astype(np.uint8)
            img[..., 1] = (yy * 255 // max(1, height - 1)).astype(np.uint8)
            img[..., 2] = (40 * i) % 256
            x0, y0 = (3 * i) % (width - 12), (2 * i) % (height - 12)
            img[y0:y0 + 12, x0:x0 + 12] = (250, 30, 30)
            cx, cy = width - 1 - (4 * i) % width, height // 2
            img[(xx - cx) ** 2 + (yy - cy) ** 2 < 49] = (20, 220, 60)
            container.mux(stream.encode(av.VideoFrame.from_ndarray(img, format="rgb24")))
        container.mux(stream.encode())
    return path


def decode_all(path: Path) -> tuple[np.ndarray, float]:
    import av

    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        frames = np.stack([f.to_ndarray(format="rgb24") for f in container.decode(stream)])
        return frames, float(stream.average_rate)


class _Tokenizer:
    """Just enough tokenizer for the processors' constructor (ids of the vision tokens)."""

    name_or_path, unk_token_id = "stub", -1

    def convert_tokens_to_ids(self, token):
        return hash(token) % 1000 + 1


def ours(cls_name: str, settings: dict):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from twinkle_core.data import qwen_vision

    return getattr(qwen_vision, cls_name)(_Tokenizer(), Qwen2VLImageProcessorPil(**settings))


def stock(kind: str, settings: dict):
    if kind == "qwen2_5_vl":
        from transformers import Qwen2VLVideoProcessor as cls
    else:
        from transformers import Qwen3VLVideoProcessor as cls
    return cls(**settings, cap_pixels_per_frame=False)


def stock_encode(proc, frames: np.ndarray) -> tuple[np.ndarray, list[int]]:
    out = proc(videos=[frames], do_sample_frames=False, return_tensors="pt")
    return out["pixel_values_videos"].numpy(), out["video_grid_thw"][0].tolist()


def our_sizing(hw, settings, frames):
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

    f = settings["patch_size"] * settings["merge_size"]
    return smart_resize(hw[0], hw[1], factor=f, min_pixels=settings["size"]["shortest_edge"],
                        max_pixels=settings["size"]["longest_edge"])


def stock_sizing(kind, hw, settings, frames):
    f = settings["patch_size"] * settings["merge_size"]
    lo, hi = settings["size"]["shortest_edge"], settings["size"]["longest_edge"]
    if kind == "qwen2_5_vl":
        from transformers.models.qwen2_vl.video_processing_qwen2_vl import smart_resize

        return smart_resize(hw[0], hw[1], factor=f, min_pixels=lo, max_pixels=hi)
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize

    return smart_resize(frames, hw[0], hw[1], temporal_factor=2, factor=f, min_pixels=lo, max_pixels=hi)


def fixed_qwen3_frames(self, frames: np.ndarray, options) -> tuple[np.ndarray, list[int]]:
    """Qwen3VisionProcessor.frames as proposed: one size for the whole clip from the Qwen3-VL video
    smart_resize over (frames, H, W) with the video config's min / max pixels, then PIL resize to it."""
    from transformers.image_processing_backends import PilBackend
    from transformers.image_utils import SizeDict
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize

    from twinkle_core.data.qwen_vision import patchify_frames

    proc = self.image_processor
    patch, temporal = proc.patch_size, proc.temporal_patch_size
    size = self._size(options)
    height, width = smart_resize(len(frames), frames.shape[1], frames.shape[2], temporal_factor=temporal,
                                 factor=patch * self.merge, min_pixels=size["shortest_edge"],
                                 max_pixels=size["longest_edge"])
    prepared = []
    for frame in frames:
        image = PilBackend.resize(proc, proc.process_image(frame), SizeDict(height=height, width=width),
                                  resample=proc.resample)
        image = proc.normalize(proc.rescale(image, proc.rescale_factor), proc.image_mean, proc.image_std)
        prepared.append(np.asarray(image, dtype=np.float32))
    clip = np.stack(prepared)
    if len(clip) % temporal:
        clip = np.concatenate([clip, np.repeat(clip[-1:], temporal - len(clip) % temporal, axis=0)])
    return patchify_frames(clip, patch, self.merge, temporal)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strict", action="store_true", help="also fail on sizing / sampling differences")
    args = parser.parse_args()

    import torch
    import torchvision
    import transformers
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
    from transformers.video_utils import VideoMetadata

    from twinkle_core.data.media import read_video
    from twinkle_core.data.vision_encode import MediaOptions

    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, torchvision {torchvision.__version__}, transformers {transformers.__version__}")
    print(f"tolerances: exact {EXACT_TOL}, resized max {RESIZE_TOL} / mean {RESIZE_MEAN_TOL}")
    families = [("qwen2_5_vl", "QwenVisionProcessor", QWEN25, QWEN25),
                ("qwen3_vl", "Qwen3VisionProcessor", QWEN3_VIDEO, QWEN3_VIDEO)]
    hard_fail, soft_fail = [], []
    with tempfile.TemporaryDirectory() as tmp:
        paths = {name: write_video(Path(tmp) / f"{name}.mp4", w, h, n, fps) for name, w, h, n, fps in VIDEOS}

        # 1. patchify on identical frames, identical settings
        print("\n1. patches on the same frames and settings (ours: PIL resize + numpy patchify; stock: torchvision)")
        print(f"{'family':<11} {'video':<18} {'T':>2} {'in HxW':>7} {'resize':>6} {'grid ours':>12} {'grid stock':>12} "
              f"{'shape':>14} {'max|d|':>9} {'mean|d|':>9}  ok")
        for kind, cls_name, our_settings, stock_settings in families:
            mine, theirs = ours(cls_name, our_settings), stock(kind, stock_settings)
            for name, path in paths.items():
                video = read_video(str(path), fps=2.0, max_frames=64)
                frames = video.frames
                pixels, grid = mine.frames(frames, MediaOptions())
                ref, ref_grid = stock_encode(theirs, frames)
                t, h, w = frames.shape[:3]
                resized = tuple(stock_sizing(kind, (h, w), stock_settings, t)) != (h, w)
                same = pixels.shape == ref.shape and grid == ref_grid
                d = np.abs(pixels - ref) if same else np.array([np.inf])
                tol = RESIZE_TOL if resized else EXACT_TOL
                ok = same and d.max() <= tol and (not resized or d.mean() <= RESIZE_MEAN_TOL)
                if not ok:
                    hard_fail.append(f"patches {kind} {name}")
                print(f"{kind:<11} {name:<18} {t:>2} {h:>3}x{w:<3} {'yes' if resized else 'no':>6} {str(grid):>12} "
                      f"{str(ref_grid):>12} {str(tuple(ref.shape)):>14} {d.max():9.2e} {d.mean():9.2e}  "
                      f"{'OK' if ok else 'MISMATCH'}")
                if kind == "qwen3_vl":  # 2. timestamps of the frame groups
                    text = mine._video_text(grid, video)
                    got = [float(x) for x in re.findall(r"<([\d.]+) seconds>", text)]
                    decoded, video_fps = decode_all(path)
                    indices = [next(i for i, f in enumerate(decoded) if np.array_equal(f, fr)) for fr in frames]
                    want = Qwen3VLProcessor._calculate_timestamps(None, list(indices), video_fps, 2)
                    want = [float(f"{x:.1f}") for x in want]
                    if got != want:
                        hard_fail.append(f"timestamps {name}")
                    print(f"{'':<11} timestamps ours {got} stock {want} {'OK' if got == want else 'MISMATCH'}")

        # 3. sizing with each checkpoint's own configs (ours reads preprocessor_config.json only)
        print("\n3. resized frame HxW with the checkpoints' configs (ours: image sizes, per frame; stock: video sizes)")
        print(f"{'family':<11} {'T':>3} {'in HxW':>10} {'ours':>10} {'stock':>10} {'tokens ours':>12} {'stock':>8}")
        cases = [(t, h, w) for t, h, w in [(7, 48, 64), (9, 56, 56), (16, 240, 320), (64, 480, 640), (64, 720, 1280),
                                           (256, 1080, 1920)]]
        ckpt = [("qwen2_5_vl", QWEN25, QWEN25), ("qwen3_vl", QWEN3_IMAGE, QWEN3_VIDEO)]
        for kind, image_settings, video_settings in ckpt:
            for t, h, w in cases:
                a, b = our_sizing((h, w), image_settings, t), stock_sizing(kind, (h, w), video_settings, t)
                p = image_settings["patch_size"] * image_settings["merge_size"]
                tok = lambda s: -(-t // 2) * (s[0] // p) * (s[1] // p)
                if tuple(a) != tuple(b):
                    soft_fail.append(f"sizing {kind} {t}x{h}x{w}")
                print(f"{kind:<11} {t:>3} {h:>4}x{w:<5} {a[0]:>4}x{a[1]:<5} {b[0]:>4}x{b[1]:<5} {tok(a):>12} {tok(b):>8}"
                      f"  {'same' if tuple(a) == tuple(b) else 'DIFFERENT'}")

        # 4. frame sampling at 2 fps
        print("\n4. frames sampled at fps=2: our read_video vs the stock processors' sample_frames")
        for kind, _, _, stock_settings in families:
            theirs = stock(kind, stock_settings)
            for name, path in paths.items():
                decoded, video_fps = decode_all(path)
                meta = VideoMetadata(total_num_frames=len(decoded), fps=video_fps, duration=len(decoded) / video_fps)
                picked = theirs.sample_frames(metadata=meta, fps=2.0)
                picked = [int(i) for i in np.asarray(picked)]
                video = read_video(str(path), fps=2.0, max_frames=64)
                mine = [next(i for i, f in enumerate(decoded) if np.array_equal(f, fr)) for fr in video.frames]
                if mine != picked:
                    soft_fail.append(f"sampling {kind} {name}")
                print(f"{kind:<11} {name:<18} n={len(decoded):>2} ours {mine} stock {picked}"
                      f"  {'same' if mine == picked else 'DIFFERENT'}")

        # 5. the proposed fix for Qwen3-VL's video sizing, simulated on an instance (library code untouched);
        # the tight config makes the clip-wide budget differ from the per-frame one on these tiny videos.
        print("\n5. Qwen3-VL video sizing: current frames() and the proposed fix (temporal smart_resize) vs stock")
        for label, settings in [("ckpt video cfg", QWEN3_VIDEO), ("tight cfg", QWEN3_TIGHT)]:
            current, fixed = ours("Qwen3VisionProcessor", settings), ours("Qwen3VisionProcessor", settings)
            fixed.frames = lambda frames, options, _self=fixed: fixed_qwen3_frames(_self, frames, options)
            theirs = stock("qwen3_vl", settings)
            for name, path in paths.items():
                frames = read_video(str(path), fps=2.0, max_frames=64).frames
                ref, ref_grid = stock_encode(theirs, frames)
                _, now_grid = current.frames(frames, MediaOptions())
                pixels, grid = fixed.frames(frames, MediaOptions())
                same = pixels.shape == ref.shape and grid == ref_grid
                d = np.abs(pixels - ref) if same else np.array([np.inf])
                ok = same and d.max() <= RESIZE_TOL and d.mean() <= RESIZE_MEAN_TOL
                if not ok:
                    hard_fail.append(f"fixed qwen3 {label} {name}")
                print(f"{label:<15} {name:<18} T={len(frames)} stock {str(ref_grid):<11} current {str(now_grid):<11} "
                      f"{'same' if now_grid == ref_grid else 'DIFFERENT':<9} fixed {str(grid):<11} "
                      f"max|d| {d.max():.2e} {'OK' if ok else 'MISMATCH'}")

    print(f"\nhard checks failed: {hard_fail or 'none'}")
    print(f"reported differences (sizing / sampling): {len(soft_fail)}")
    return 1 if hard_fail or (args.strict and soft_fail) else 0


if __name__ == "__main__":
    sys.exit(main())
