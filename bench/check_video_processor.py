"""One-off check: our Qwen video encoding (twinkle_core.data.qwen_vision) against transformers' stock
`Qwen2VLVideoProcessor` (Qwen2.5-VL) and `Qwen3VLVideoProcessor` (Qwen3-VL).

"Ours" is built the way the library builds it: `load_qwen_vision_processor` on a temporary checkpoint-like folder
holding preprocessor_config.json (image settings: QWEN25 / QWEN3_IMAGE) and, for Qwen3-VL,
video_preprocessor_config.json (video settings: QWEN3_VIDEO), with config {"model_type": "qwen2_5_vl"} /
{"model_type": "qwen3_vl"}. The stock processors get the video settings (for Qwen2.5-VL its image settings, as
its checkpoints have no video config).

The stock video processors need torchvision, which the project's venv does not have, so run this from a
separate venv (any location; /tmp/tvenv is an example) with the repo on PYTHONPATH:

    python3 -m venv /tmp/tvenv && /tmp/tvenv/bin/pip install torch==2.14.1 torchvision==0.29.1 \
        && /tmp/tvenv/bin/pip install transformers==5.24.0 av==18.1.0 pillow numpy safetensors pyarrow jinja2
    PYTHONPATH=. /tmp/tvenv/bin/python bench/check_video_processor.py   # from the repository root

It writes a few short MPEG-4 videos (PyAV: moving shapes, sizes 56x56 .. 96x64, odd frame counts, 4-10 fps)
into a temporary folder, decodes and samples them with twinkle_core.data.media.read_video, and checks:

1. patches (hard check): the SAME sampled frames through our `frames()` and the stock processor
   (do_sample_frames=False). Sizes that need no resize must match exactly (tolerance 0 on uint8 inputs: we
   allow EXACT_TOL for float rounding of the fused rescale+normalise); sizes that need a resize go through PIL
   bicubic (ours) and torchvision bicubic antialias (stock): allowed max abs difference RESIZE_TOL (a few uint8
   steps after normalisation), mean abs difference RESIZE_MEAN_TOL. Grids must be equal.
2. Qwen3-VL timestamps (hard check): the `<t seconds>` of each frame group in our prompt text against
   `Qwen3VLProcessor._calculate_timestamps` on the same frame indices.
3. sizing with the checkpoints' own configs (hard check), for clips (T, H, W) from 7x48x64 to 256x1080x1920:
   clips up to FULL_PIXELS (T*H*W) go through our frames() and the stock processor on random uint8 frames and
   their grids must be equal; for larger ones (full frames would be too heavy) our sizing decision -- Qwen3-VL:
   `clip_size` on a broadcast array of the clip's shape; Qwen2.5-VL, which sizes each frame alone: frames() on
   one frame -- must give the stock smart_resize's size (Qwen3-VL: over frames * height * width).
4. frame sampling at fps=2 (informational; fails only with --strict): our read_video picks against the stock
   processor's sample_frames on the full decoded clip. They differ by design: read_video samples by
   presentation time, about `fps` frames a second spread evenly from the first frame to the last (both kept),
   the stock processors by their own index arithmetic.
5. Qwen3-VL with a tight video config (hard check, as 1): min 8192 / max 16384 pixels over T*H*W, so that the
   clip-wide budget shrinks these tiny videos through the loader's video_preprocessor_config.json.

Results (transformers 5.24.0, torch 2.14.1, torchvision 0.29.1; exit 0):
1. all 10 video/family cases OK, grids equal. Unresized: max |d| <= 2.4e-07. Resized: Qwen2.5-VL max |d|
   1.50e-02 (one uint8 step at CLIP std), mean <= 5.3e-05; Qwen3-VL max |d| 7.84e-03 (one step at std 0.5),
   mean <= 2.3e-07. Qwen3-VL timestamps equal on all 5 videos.
3. all 12 cases give equal grids, e.g. Qwen3-VL 64x720x1280 -> 448x832 [32, 28, 52], 256x1080x1920 -> 224x416
   [128, 14, 26] (before the library fix ours used the image config per frame: 704x1280 / 1088x1920, and
   upscaled tiny clips to >= 65536 pixels a frame, 56x56 -> 256x256); Qwen2.5-VL 256x1080x1920 -> 1092x1932
   [128, 78, 138].
4. 9 of 10 picks differ (only Qwen3-VL v84x56_15f_10fps is the same), the documented policy difference.
5. all 5 OK, grids equal (e.g. 56x84 -> [2, 2, 4]), max |d| <= 7.84e-03.
"""
from __future__ import annotations

import argparse
import json
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
FULL_PIXELS = 16 * 240 * 320  # section 3: clips up to this many T*H*W pixels go through frames()

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


def ours(kind: str, image_settings: dict, video_settings: dict | None, folder: Path):
    """Our processor through the library's loader, from a checkpoint-like folder holding preprocessor_config.json
    (image settings) and, where given, video_preprocessor_config.json (video settings)."""
    from twinkle_core.data.qwen_vision import VIDEO_CONFIG, load_qwen_vision_processor

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "preprocessor_config.json").write_text(json.dumps(image_settings))
    if video_settings is not None:
        (folder / VIDEO_CONFIG).write_text(json.dumps(video_settings))
    return load_qwen_vision_processor(_Tokenizer(), folder, {"model_type": kind})


def stock(kind: str, settings: dict):
    if kind == "qwen2_5_vl":
        from transformers import Qwen2VLVideoProcessor as cls
    else:
        from transformers import Qwen3VLVideoProcessor as cls
    return cls(**settings, cap_pixels_per_frame=False)


def stock_encode(proc, frames: np.ndarray) -> tuple[np.ndarray, list[int]]:
    out = proc(videos=[frames], do_sample_frames=False, return_tensors="pt")
    return out["pixel_values_videos"].numpy(), out["video_grid_thw"][0].tolist()


def stock_sizing(kind, hw, settings, frames):
    f = settings["patch_size"] * settings["merge_size"]
    lo, hi = settings["size"]["shortest_edge"], settings["size"]["longest_edge"]
    if kind == "qwen2_5_vl":
        from transformers.models.qwen2_vl.video_processing_qwen2_vl import smart_resize

        return smart_resize(hw[0], hw[1], factor=f, min_pixels=lo, max_pixels=hi)
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize

    return smart_resize(frames, hw[0], hw[1], temporal_factor=2, factor=f, min_pixels=lo, max_pixels=hi)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strict", action="store_true", help="also fail on frame sampling differences (section 4)")
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
    # (kind, image settings -> preprocessor_config.json, video settings -> video_preprocessor_config.json or None,
    #  the stock video processor's settings)
    families = [("qwen2_5_vl", QWEN25, None, QWEN25),
                ("qwen3_vl", QWEN3_IMAGE, QWEN3_VIDEO, QWEN3_VIDEO)]
    hard_fail, soft_fail = [], []
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        paths = {name: write_video(tmp / f"{name}.mp4", w, h, n, fps) for name, w, h, n, fps in VIDEOS}
        processors = {kind: ours(kind, image, video, tmp / f"ckpt_{kind}") for kind, image, video, _ in families}

        # 1. patchify on identical frames; ours loaded from the checkpoint-like folder, stock from the video settings
        print("\n1. patches on the same frames (ours: load_qwen_vision_processor, PIL resize + numpy patchify; "
              "stock: torchvision)")
        print(f"{'family':<11} {'video':<18} {'T':>2} {'in HxW':>7} {'resize':>6} {'grid ours':>12} {'grid stock':>12} "
              f"{'shape':>14} {'max|d|':>9} {'mean|d|':>9}  ok")
        for kind, _, _, stock_settings in families:
            mine, theirs = processors[kind], stock(kind, stock_settings)
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

        # 3. sizing with each checkpoint's own configs. Clips up to FULL_PIXELS (T*H*W) go through both encoders on
        # random frames; larger ones compare our sizing decision (Qwen3-VL: clip_size on a broadcast array of the
        # clip's shape; Qwen2(.5)-VL, which sizes each frame alone: frames() on one frame) with the stock smart_resize.
        print("\n3. resized frame HxW with the checkpoints' configs (ours: load_qwen_vision_processor; "
              "stock: video config)")
        print(f"{'family':<11} {'T':>3} {'in HxW':>10} {'how':<11} {'ours':>10} {'stock':>10} {'grid ours':>15} "
              f"{'grid stock':>15}  ok")
        cases = [(7, 48, 64), (9, 56, 56), (16, 240, 320), (64, 480, 640), (64, 720, 1280), (256, 1080, 1920)]
        for kind, _, _, stock_settings in families:
            mine, theirs = processors[kind], stock(kind, stock_settings)
            p = mine.video_processor.patch_size
            for t, h, w in cases:
                if t * h * w <= FULL_PIXELS:
                    frames = rng.integers(0, 256, (t, h, w, 3), dtype=np.uint8)
                    how, (_, grid), (_, ref_grid) = "frames()", mine.frames(frames, MediaOptions()), \
                        stock_encode(theirs, frames)
                else:
                    size = mine._size(MediaOptions(), mine.video_processor)
                    fixed = mine.clip_size(np.broadcast_to(np.zeros(3, np.uint8), (t, h, w, 3)), size)
                    if fixed is None:
                        how, (_, one) = "frames(1st)", mine.frames(rng.integers(0, 256, (1, h, w, 3), np.uint8),
                                                                  MediaOptions())
                        fixed = (one[1] * p, one[2] * p)
                    else:
                        how = "clip_size"
                    grid = [-(-t // 2), fixed[0] // p, fixed[1] // p]
                    b = stock_sizing(kind, (h, w), stock_settings, t)
                    ref_grid = [-(-t // 2), b[0] // p, b[1] // p]
                a, b = (grid[1] * p, grid[2] * p), (ref_grid[1] * p, ref_grid[2] * p)
                ok = grid == ref_grid
                if not ok:
                    hard_fail.append(f"sizing {kind} {t}x{h}x{w}")
                print(f"{kind:<11} {t:>3} {h:>4}x{w:<5} {how:<11} {a[0]:>4}x{a[1]:<5} {b[0]:>4}x{b[1]:<5} "
                      f"{str(grid):>15} {str(ref_grid):>15}  {'OK' if ok else 'MISMATCH'}")

        # 4. frame sampling at 2 fps (a documented policy difference: read_video samples by presentation time)
        print("\n4. frames sampled at fps=2: our read_video vs the stock processors' sample_frames (informational)")
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

        # 5. a tight Qwen3-VL video budget, so that the clip-wide sizing shrinks these tiny videos (section 1 only
        # tests that it does not upscale them as the image config would)
        print("\n5. Qwen3-VL with a tight video config (min 8192 / max 16384 pixels over T*H*W), loaded from a folder")
        mine = ours("qwen3_vl", QWEN3_IMAGE, QWEN3_TIGHT, tmp / "ckpt_qwen3_tight")
        theirs = stock("qwen3_vl", QWEN3_TIGHT)
        for name, path in paths.items():
            frames = read_video(str(path), fps=2.0, max_frames=64).frames
            ref, ref_grid = stock_encode(theirs, frames)
            pixels, grid = mine.frames(frames, MediaOptions())
            same = pixels.shape == ref.shape and grid == ref_grid
            d = np.abs(pixels - ref) if same else np.array([np.inf])
            ok = same and d.max() <= RESIZE_TOL and d.mean() <= RESIZE_MEAN_TOL
            if not ok:
                hard_fail.append(f"tight qwen3 {name}")
            print(f"{name:<18} T={len(frames)} in {frames.shape[1]}x{frames.shape[2]} grid ours {str(grid):<11} "
                  f"stock {str(ref_grid):<11} max|d| {d.max():.2e} mean|d| {d.mean():.2e} {'OK' if ok else 'MISMATCH'}")

    print(f"\nhard checks failed: {hard_fail or 'none'}")
    print(f"reported differences (frame sampling): {len(soft_fail)}")
    return 1 if hard_fail or (args.strict and soft_fail) else 0


if __name__ == "__main__":
    sys.exit(main())
