"""Vision-language rows: both layouts, every kind of media reference, and bad media as bad rows."""
from __future__ import annotations

import base64
import json

import numpy as np
import pytest
from vision_models import write_image, write_video

from twinkle_core.data import DatasetError, RowError, get_row_format, load_rows
from twinkle_core.data.media import read_video

QUESTION = {"role": "user", "content": "<image>What colour is it?"}
ANSWER = {"role": "assistant", "content": "Red."}


def _swift(images, question=QUESTION, **extra):
    return {"messages": [question, ANSWER], "images": images, **extra}


def _write(path, rows):
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))
    return path


def test_both_layouts_and_every_reference_kind_normalise_to_one_row(tmp_path):
    red = write_image(tmp_path / "media" / "red.png")
    data_url = "data:image/png;base64," + base64.b64encode(red.read_bytes()).decode()
    content_list = {"messages": [{"role": "user", "content": [{"type": "image", "image": "media/red.png"},
                                                              {"type": "text", "text": "What colour is it?"}]}, ANSWER]}
    rows = [_swift(["media/red.png"]), content_list, _swift([str(red)]), _swift([data_url]),
            _swift(["pkg://matplotlib/mpl-data/images/home.png"])]
    loaded = load_rows(_write(tmp_path / "vl.jsonl", rows), "vision_chat")
    assert loaded.bad == []
    as_bytes = get_row_format("vision_chat").check(_swift([{"bytes": red.read_bytes(), "path": None}]))
    assert as_bytes["images"] == ["data:application/octet-stream;base64," + base64.b64encode(red.read_bytes()).decode()]
    first = loaded.rows[0]
    assert first == {"messages": [QUESTION, ANSWER], "images": [str(red.resolve())], "videos": []}
    assert loaded.rows[1] == first and loaded.rows[2] == first  # content list and absolute path: the same row
    assert loaded.rows[3]["images"] == [data_url]  # base64 stays as it is
    assert loaded.rows[4]["images"][0].endswith("mpl-data/images/home.png")


def test_bad_media_and_placeholder_counts_are_bad_rows_with_file_and_line(tmp_path):
    write_image(tmp_path / "red.png")
    (tmp_path / "broken.png").write_text("not an image")
    (tmp_path / "broken.mp4").write_bytes(b"\x00" * 64)
    write_video(tmp_path / "clip.mp4", frames=4)
    good = _swift(["red.png"])
    two = {"role": "user", "content": "<image><image>Same?"}
    bad = {
        2: (_swift(["missing.png"]), "images[0]: file 'missing.png' does not exist (relative to the data file's folder"),
        3: (_swift(["broken.png"]), "images[0]:"),
        4: (_swift(["red.png"], question=two), "2 <image> placeholder(s) in the messages but 1 images"),
        5: (_swift([]), "1 <image> placeholder(s) in the messages but 0 images"),
        6: ({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "<image>"}],
             "images": ["red.png"]}, "messages[1] is an assistant reply with a <image> placeholder"),
        7: (_swift(["red.png"], question={"role": "user", "content": "<image><video>?"}, videos=["broken.mp4"]),
            "videos[0]:"),
        8: (_swift(["data:image/png;base64,!!!!"]), "images[0]: base64 data"),
    }
    rows = [good] + [row for row, _ in bad.values()] + [_swift(["red.png"], question={
        "role": "user", "content": "<image>and <video>"}, videos=["clip.mp4"])] + [good] * 13
    path = _write(tmp_path / "vl.jsonl", rows)
    loaded = load_rows(path, "vision_chat", max_bad_fraction=0.5)
    assert [(b.file, b.line) for b in loaded.bad] == [(str(path), line) for line in bad]
    for row in loaded.bad:
        assert row.reason.startswith(bad[row.line][1]), (row, bad[row.line][1])
    assert "not a readable image" in loaded.bad[1].reason and "not a readable video" in loaded.bad[5].reason
    assert len(loaded.rows) == 15 and loaded.rows[1]["videos"] == [str((tmp_path / "clip.mp4").resolve())]
    with pytest.raises(DatasetError, match=r"7 of 22 rows are bad .* max_bad_fraction=0.1"):
        load_rows(path, "vision_chat", max_bad_fraction=0.1)


def test_rows_passed_directly_resolve_paths_from_the_given_folder(tmp_path):
    write_image(tmp_path / "red.png")
    row_format = get_row_format("vision_chat")
    assert row_format.check(_swift(["red.png"]), tmp_path)["images"] == [str((tmp_path / "red.png").resolve())]
    with pytest.raises(RowError, match="does not exist"):
        row_format.check(_swift(["red.png"]), tmp_path / "elsewhere")


def test_video_frames_are_sampled_at_fps_and_capped_at_max_frames(tmp_path):
    clip = write_video(tmp_path / "clip.mp4", frames=12, fps=4)  # 3 s of frames, the last at 2.75 s
    at_two = read_video(str(clip), fps=2.0, max_frames=64)
    assert at_two.frames.shape == (7, 56, 56, 3) and at_two.frames.dtype == np.uint8  # round(2.75 * 2) + 1
    assert at_two.sampled_fps == pytest.approx(6 / 2.75)
    capped = read_video(str(clip), fps=4.0, max_frames=3)
    assert capped.frames.shape[0] == 3 and capped.sampled_fps == pytest.approx(2 / 2.75)
