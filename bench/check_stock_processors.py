"""One-off check: a saved checkpoint of each vision-language family opens with transformers' stock processor
(`AutoProcessor.from_pretrained`), and that processor encodes a conversation exactly as our encoder does.

    # in the project's venv: tiny checkpoints of the four families, saved by TransformersModel.save
    .venv/bin/python bench/check_stock_processors.py --save DIR
    # in a venv with torchvision, VENV (the stock processors need it; the recipe is in check_video_processor.py):
    PYTHONPATH=. $VENV/bin/python bench/check_stock_processors.py --check DIR

For each family (Qwen2.5-VL, Qwen3-VL, Qwen 3.5 VL, InternVL; and an OpenGVLab-layout InternVL with an
InternLM2 language model as `resolve_model` converts it) the check encodes a user turn with an image (and
for the Qwen families one with a video) through `encode_vision_prompt`, collapses each medium's token run back
to the stock processor's single placeholder, and gives that text with the same image (the same sampled frames)
to the stock processor. Hard checks: equal input_ids, equal grids, pixel values within PIXEL_TOL (the same
transformers image processors on both sides; video frames go through our PIL resize and the stock torchvision
one), equal mm_token_type_ids where the stock processor returns them.

Results (transformers 5.24.0, torch 2.14.1, torchvision 0.29.1; exit 0): all 8 cases OK (5 checkpoints with
an image, the 3 Qwen ones with a video). input_ids, grids and mm_token_type_ids equal everywhere; pixels:
Qwen2.5-VL image and video max |d| 1.50e-02 (one uint8 step at CLIP std: PIL against torchvision
resampling), Qwen3-VL / Qwen 3.5 VL image 7.84e-03, video 5.91e-08,
InternVL (native and converted) 1.75e-02. Informational: Qwen2.5-VL second_per_grid_ts ours 1.0, stock 0.9 on a
9-frame 4 fps clip sampled at 2 fps (ours: the picked frames' own rate, 0.5 s apart; stock and qwen-vl-utils:
picked / decoded frames x fps, which counts the clip as 2.25 s; the two agree as clips grow).
What this check found and the library fixed: InternVL checkpoints converted from OpenGVLab's layout did not
open with AutoProcessor (the tokenizer lacked the named media tokens, and there was no processor_config.json).
Differences kept on purpose: the stock InternVL processor also marks <img> and </img> as image tokens in
mm_token_type_ids; transformers 5.24's Qwen3-VL processor keeps the chat template's <|vision_start|> ...
<|vision_end|> around the frame groups of a video, which the Qwen3-VL processor released with the model (and
ours) replaces.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import warnings
from pathlib import Path

import numpy as np

warnings.filterwarnings("ignore")
ROOT = Path(__file__).resolve().parents[1]
PIXEL_TOL = 0.02  # about one uint8 step after CLIP normalisation (1/255/0.2686 = 0.0146)
FAMILIES = ("qwen2_5_vl", "qwen3_vl", "qwen3_5_vl", "internvl", "internvl_converted")
VIDEO_FAMILIES = ("qwen2_5_vl", "qwen3_vl", "qwen3_5_vl")


def save(out: Path) -> None:
    """Tiny checkpoints, each re-saved through the library's own save path (a full checkpoint)."""
    sys.path[:0] = [str(ROOT / "tests")]
    from vision_models import (save_tiny_internvl, save_tiny_qwen2_5_vl, save_tiny_qwen3_5_vl, save_tiny_qwen3_vl,
                               tiny_native_internvl, write_image, write_internvl_chat, write_video)

    from twinkle_core.hub import resolve_model
    from twinkle_core.models import TransformersModel

    builders = {"qwen2_5_vl": save_tiny_qwen2_5_vl, "qwen3_vl": save_tiny_qwen3_vl,
                "qwen3_5_vl": save_tiny_qwen3_5_vl, "internvl": save_tiny_internvl}
    for family, build in builders.items():
        source = build(out / "source" / family)
        model = TransformersModel(str(source), mixed_precision="no", objective="vision_lm")
        model.save(family, out / "saved")
        print(f"saved {family}: {sorted(p.name for p in (out / 'saved' / family).iterdir())}")
    # An OpenGVLab-layout (remote-code) InternVL with an InternLM2 language model, converted on resolve as a
    # download of InternVL2_5-8B is: what a user of the original checkpoints gets.
    os.environ["TWINKLE_CACHE"] = str(out / "cache")
    native, tokenizer = tiny_native_internvl("llama")
    original = write_internvl_chat(out / "source" / "InternVL2_5-8B", native, tokenizer)
    shutil.copytree(resolve_model(str(original)).path, out / "saved" / "internvl_converted")
    print("converted the original-layout InternVL")
    write_image(out / "media" / "picture.png", seed=1, size=(96, 72))
    write_video(out / "media" / "clip.mp4", frames=9, fps=4, size=(64, 64))


def _collapse(text: str, family: str) -> str:
    """Our expanded media tokens back to the placeholder the stock processor expands."""
    if family.startswith("internvl"):
        return re.sub(r"<img>(<IMG_CONTEXT>)+</img>", "<IMG_CONTEXT>", text)
    text = re.sub(r"(<\|image_pad\|>)+", "<|image_pad|>", text)
    if family == "qwen2_5_vl":
        return re.sub(r"(<\|video_pad\|>)+", "<|video_pad|>", text)
    # Qwen3-VL: "<t seconds><|vision_start|><pads><|vision_end|>" per frame group, nothing around them, as the
    # Qwen3-VL processor released with the model writes it in place of the template's
    # <|vision_start|><|video_pad|><|vision_end|>. transformers 5.24's processor replaces the <|video_pad|> only
    # and keeps the template's pair around the groups, so it is given the bare token ("vLLM's" input).
    groups = r"(?:<[0-9.]+ seconds><\|vision_start\|>(?:<\|video_pad\|>)+<\|vision_end\|>)+"
    return re.sub(groups, "<|video_pad|>", text)


def _compare(name: str, ours, theirs, exact: bool = True) -> list[str]:
    ours, theirs = np.asarray(ours), np.asarray(theirs)
    if ours.shape != theirs.shape:
        return [f"{name}: shape ours {ours.shape} stock {theirs.shape}"]
    if exact and not np.array_equal(ours, theirs):
        return [f"{name}: {int((ours != theirs).sum())} of {ours.size} values differ"]
    if not exact:
        diff = float(np.abs(ours.astype(np.float64) - theirs.astype(np.float64)).max()) if ours.size else 0.0
        print(f"    {name}: max |ours - stock| = {diff:.2e}")
        if diff > PIXEL_TOL:
            return [f"{name}: max difference {diff:.3g} > {PIXEL_TOL}"]
    return []


def check_one(family: str, folder: Path, media: Path, kind: str) -> list[str]:
    from transformers import AutoProcessor, AutoTokenizer

    from twinkle_core.data.media import read_video
    from twinkle_core.data.vision_encode import encode_vision_prompt, load_vision_processor

    tokenizer = AutoTokenizer.from_pretrained(folder)
    ours_processor = load_vision_processor(tokenizer, folder)
    ref = str(media / ("picture.png" if kind == "image" else "clip.mp4"))
    messages = [{"role": "user", "content": [{"type": kind, kind: ref}, {"type": "text", "text": "What is it?"}]}]
    ours = encode_vision_prompt(ours_processor, messages)
    text = tokenizer.decode(ours["input_ids"])
    assert tokenizer(text, add_special_tokens=False)["input_ids"] == ours["input_ids"], "decode does not round-trip"
    stock = AutoProcessor.from_pretrained(folder)
    collapsed = _collapse(text, family)
    if kind == "image":
        from PIL import Image

        out = stock(text=[collapsed], images=[Image.open(ref).convert("RGB")], return_tensors="np",
                    return_mm_token_type_ids=True)
        keys = [("pixel_values", "pixel_values", False)]
        if not family.startswith("internvl"):  # InternVL's tiles have no grid
            keys.append(("image_grid_thw", "image_grid_thw", True))
    else:
        from transformers.video_utils import VideoMetadata

        video = read_video(ref, 2.0, 64)
        source_fps = 4.0  # the clip's rate (write_video)
        indices = [round(t * source_fps) for t in video.times]
        meta = VideoMetadata(total_num_frames=9, fps=source_fps, duration=9 / source_fps, frames_indices=indices)
        extra = {"fps": video.sampled_fps} if family == "qwen2_5_vl" else {}
        out = stock(text=[collapsed], videos=[video.frames], video_metadata=[meta], do_sample_frames=False,
                    return_tensors="np", return_mm_token_type_ids=True, **extra)
        keys = [("pixel_values_videos", "pixel_values_videos", False), ("video_grid_thw", "video_grid_thw", True)]
    problems = _compare("input_ids", ours["input_ids"], out["input_ids"][0])
    if problems:
        print("    ours :", text[:400])
        print("    stock:", tokenizer.decode(out["input_ids"][0])[:400])
    for our_key, stock_key, exact in keys:
        if stock_key not in out:
            problems.append(f"stock output has no {stock_key}")
            continue
        ours_value = ours[our_key] if "grid" in our_key else np.asarray(ours[our_key], np.float32).reshape(
            -1, *ours["image_shape" if kind == "image" else "video_shape"])
        problems += _compare(our_key, ours_value, out[stock_key], exact)
    if "mm_token_type_ids" in out:
        stock_types = np.array(out["mm_token_type_ids"][0])
        if family.startswith("internvl"):  # the stock processor marks <img> and </img> as image tokens too; ours marks
            # the context tokens only, so that two adjacent images stay two runs (truncation counts media by
            # runs). InternVL's model takes no mm_token_type_ids.
            ends = np.isin(out["input_ids"][0], tokenizer.convert_tokens_to_ids(["<img>", "</img>"]))
            stock_types[ends] = 0
        problems += _compare("mm_token_type_ids", ours["mm_token_type_ids"], stock_types)
    if family == "qwen2_5_vl" and kind == "video":  # informational: the rates differ by definition
        print(f"    second_per_grid_ts: ours {ours['second_per_grid_ts']} (2 frames / the picks' own rate) stock "
              f"{np.round(out['second_per_grid_ts'], 4).tolist()} (2 / (picked / decoded frames x the file's fps))")
    return problems


def check(root: Path) -> int:
    import transformers

    print(f"transformers {transformers.__version__}")
    failures = 0
    for family in FAMILIES:
        for kind in ("image", "video") if family in VIDEO_FAMILIES else ("image",):
            print(f"{family} {kind}:")
            try:
                problems = check_one(family, root / "saved" / family, root / "media", kind)
            except Exception as exc:  # noqa: BLE001  (report every family, then fail)
                problems = [f"{type(exc).__name__}: {exc}"]
            for problem in problems:
                print(f"    FAIL {problem}")
            print(f"    {'OK' if not problems else 'FAILED'}")
            failures += bool(problems)
    return 1 if failures else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--save", type=Path, help="write the tiny saved checkpoints and media here")
    group.add_argument("--check", type=Path, help="compare the stock processors with ours on them")
    args = parser.parse_args()
    if args.save:
        save(args.save)
        return 0
    return check(args.check)


if __name__ == "__main__":
    sys.exit(main())
