"""The bundled vision_shapes set: what build.py writes, and every row reads, tokenizes and encodes with a tiny
Qwen2.5-VL (images and videos), with no bad row."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from vision_models import PIXELS, save_tiny_qwen2_5_vl

from twinkle_core.data import get_row_format, load_tokenized, tokenize_dataset
from twinkle_core.datasets.vision_shapes import build
from twinkle_core.hub import resolve_dataset

FOLDER = Path(build.__file__).parent
ROWS = {"train": 170, "heldout": 56}  # 54 and 18 pictures x 3 questions, 4 and 1 videos x 2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_qwen2_5_vl(tmp_path_factory.mktemp("qwen_vl") / "model")


def test_the_script_writes_the_committed_rows_and_pictures(tmp_path):
    build.build(tmp_path)
    for split in ROWS:
        assert (tmp_path / f"{split}.jsonl").read_bytes() == (FOLDER / f"{split}.jsonl").read_bytes(), split
    pictures = sorted(path.name for path in (FOLDER / "images").glob("*.png"))
    assert len(pictures) == 72 and pictures == sorted(path.name for path in (tmp_path / "images").glob("*.png"))
    assert all((tmp_path / "images" / name).read_bytes() == (FOLDER / "images" / name).read_bytes()
               for name in pictures)
    # Video bytes carry the FFmpeg version inside PyAV's wheel; the same names are written.
    videos = [sorted(path.name for path in (folder / "videos").iterdir()) for folder in (tmp_path, FOLDER)]
    assert videos[0] == videos[1] and len(videos[0]) == 5
    size = sum(path.stat().st_size for path in FOLDER.rglob("*") if path.is_file() and path.suffix != ".pyc")
    assert size < 200_000, size  # small enough to ship in the package


def test_held_out_pictures_are_unseen_and_every_answer_is_one_of_the_taught_ones():
    rows = {split: [json.loads(line) for line in (FOLDER / f"{split}.jsonl").read_text().splitlines()]
            for split in ROWS}
    assert {split: len(found) for split, found in rows.items()} == ROWS
    media = {split: {row.get("images", row.get("videos"))[0] for row in found} for split, found in rows.items()}
    assert not media["train"] & media["heldout"]
    answers = {split: {row["messages"][1]["content"] for row in found} for split, found in rows.items()}
    assert answers["heldout"] <= answers["train"]
    assert {"Red.", "Blue.", "A circle.", "Triangles.", "Four."} <= answers["heldout"]


@pytest.mark.parametrize("split", ROWS)
def test_every_row_tokenizes_with_its_media_and_no_bad_row(split, model_dir):
    path = resolve_dataset(f"pkg://twinkle_core/datasets/vision_shapes/{split}.jsonl").path  # as the flow finds it
    dataset = tokenize_dataset(path, model_dir, kind="vision_chat", max_length=128,
                               encode_options={"min_pixels": PIXELS[0], "max_pixels": PIXELS[1]})
    assert (dataset.num_rows, dataset.num_bad) == (ROWS[split], 0)
    stored = load_tokenized(dataset)
    images = [row for row in stored if row["image_rows"]]
    videos = [row for row in stored if row["video_rows"]]
    assert (len(images), len(videos)) == ({"train": 162, "heldout": 54}[split], {"train": 8, "heldout": 2}[split])
    # 112x112 pictures at 56x56 pixels: 4x4 patches of 14, 4 image tokens. A video's 8 frames span 1.75 s:
    # 5 sampled at 2 per second, in 3 groups of 2 frames.
    assert {tuple(map(tuple, row["image_grid_thw"])) for row in images} == {((1, 4, 4),)}
    assert {row["mm_token_type_ids"].count(1) for row in images} == {4}
    assert {tuple(map(tuple, row["video_grid_thw"])) for row in videos} == {((3, 4, 4),)}
    batch = get_row_format("vision_chat").collate(stored[:8], pad_token_id=0)
    assert batch["pixel_values"].shape[1] == 3 * 2 * 14 * 14  # channels x temporal patch x patch x patch
