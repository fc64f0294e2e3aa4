"""Builds the bundled vision_shapes set (images/, videos/, train.jsonl, heldout.jsonl), deterministically.

    python -m twinkle_core.datasets.vision_shapes.build
    python twinkle_core/datasets/vision_shapes/build.py

Every picture is drawn here: 1 to 4 shapes of one kind (circle, square or triangle) and one colour, each in
its own quarter of a white 112x112 canvas, at a seeded offset and size. All 72 (colour, shape, count)
combinations are drawn once; for each (colour, shape) the count (colour + shape) % 4 + 1 goes to heldout,
the other three to train, so held-out pictures are new combinations of colours, shapes and counts that train
has seen. Each picture gets three rows: its colour, its shape and its count, asked in one of a few wordings.
The five videos are a coloured dot crossing the canvas in one of four directions (8 frames at 4 frames per
second, MPEG-4 in an .mp4 file), asked which way it moves and what colour it is; the last one is held out.
Rows are ms-swift's layout with paths relative to this folder. Needs Pillow, and PyAV for the videos.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

SEED = 20261205
HERE = Path(__file__).resolve().parent
SIZE = 112  # 4x4 of Qwen2.5-VL's 28-pixel merged patches: 16 image tokens at the model's own sizes
CELL = SIZE // 2
COLOURS = {"red": (220, 30, 30), "green": (30, 160, 60), "blue": (40, 70, 220), "yellow": (240, 200, 20),
           "purple": (140, 50, 170), "orange": (245, 130, 20)}
SHAPES = ("circle", "square", "triangle")
NUMBERS = ("one", "two", "three", "four")
CELLS = ((0, 0), (1, 0), (0, 1), (1, 1))  # (column, row) of each quarter

COLOUR_QUESTIONS = ("What colour are the shapes?", "Which colour is used in this picture?",
                    "What is the colour of the shapes in the image?")
SHAPE_QUESTIONS = ("What shape is drawn here?", "Which kind of shape do you see?", "What shape are the figures?")
COUNT_QUESTIONS = ("How many shapes are there?", "Count the shapes in the picture.",
                   "How many figures does the image show?")
VIDEOS = (("right", "red", (0, 1)), ("down", "blue", (1, 0)), ("left", "green", (0, -1)),
          ("up", "orange", (-1, 0)), ("left", "purple", (0, -1)))  # direction, colour, (row, column) step sign;
# the last is held out: a colour and direction train has, not together
FRAMES, FPS, DOT = 8, 4, 12


def draw_shape(draw: ImageDraw.ImageDraw, shape: str, cell: tuple[int, int], rng: random.Random, rgb) -> None:
    """One shape inside its quarter, 30-40 pixels across, at a random offset that keeps it inside."""
    size = rng.randint(30, 40)
    left = cell[0] * CELL + rng.randint(4, CELL - 4 - size)
    top = cell[1] * CELL + rng.randint(4, CELL - 4 - size)
    box = (left, top, left + size, top + size)
    if shape == "circle":
        draw.ellipse(box, fill=rgb)
    elif shape == "square":
        draw.rectangle(box, fill=rgb)
    else:
        draw.polygon([(left + size // 2, top), (left, top + size), (left + size, top + size)], fill=rgb)


def picture(colour: str, shape: str, count: int, rng: random.Random) -> Image.Image:
    image = Image.new("RGB", (SIZE, SIZE), (255, 255, 255))
    draw = ImageDraw.Draw(image)
    for cell in rng.sample(CELLS, count):
        draw_shape(draw, shape, cell, rng, COLOURS[colour])
    return image


def chat(question: str, answer: str, key: str, path: str) -> dict:
    placeholder = "<image>" if key == "images" else "<video>"
    return {"messages": [{"role": "user", "content": placeholder + question},
                         {"role": "assistant", "content": answer}], key: [path]}


def picture_rows(colour: str, shape: str, count: int, path: str, rng: random.Random) -> list[dict]:
    shapes = f"A {shape}." if count == 1 else f"{shape.capitalize()}s."
    return [chat(rng.choice(COLOUR_QUESTIONS), f"{colour.capitalize()}.", "images", path),
            chat(rng.choice(SHAPE_QUESTIONS), shapes, "images", path),
            chat(rng.choice(COUNT_QUESTIONS), f"{NUMBERS[count - 1].capitalize()}.", "images", path)]


def write_video(path: Path, colour: str, step: tuple[int, int]) -> None:
    """A dot crossing the canvas through its middle, one frame per position."""
    import av

    positions = np.linspace(DOT, SIZE - DOT, FRAMES)
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=FPS, options={"qscale": "4"})
        stream.width = stream.height = SIZE
        stream.pix_fmt = "yuv420p"
        stream.codec_context.thread_count = 1  # one thread: the same bytes on every run
        for index in range(FRAMES):
            along = positions[index] if sum(step) > 0 else positions[-1 - index]
            row, column = (along, SIZE / 2) if step[0] else (SIZE / 2, along)
            image = Image.new("RGB", (SIZE, SIZE), (255, 255, 255))
            ImageDraw.Draw(image).ellipse((column - DOT, row - DOT, column + DOT, row + DOT), fill=COLOURS[colour])
            frame = av.VideoFrame.from_ndarray(np.asarray(image), format="rgb24")
            container.mux(stream.encode(frame))
        container.mux(stream.encode())


def build(folder: Path = HERE) -> None:
    rng = random.Random(SEED)
    (folder / "images").mkdir(parents=True, exist_ok=True)
    (folder / "videos").mkdir(exist_ok=True)
    splits: dict[str, list[dict]] = {"train": [], "heldout": []}
    for c, colour in enumerate(COLOURS):
        for s, shape in enumerate(SHAPES):
            for count in range(1, 5):
                name = f"images/{colour}_{shape}_{count}.png"
                picture(colour, shape, count, rng).save(folder / name, optimize=True)
                split = "heldout" if count == (c + s) % 4 + 1 else "train"
                splits[split].extend(picture_rows(colour, shape, count, name, rng))
    for index, (direction, colour, step) in enumerate(VIDEOS):
        name = f"videos/{colour}_dot_{direction}.mp4"
        write_video(folder / name, colour, step)
        split = "heldout" if index == len(VIDEOS) - 1 else "train"
        splits[split] += [chat("Which way does the dot move?", f"{direction.capitalize()}.", "videos", name),
                          chat("What colour is the moving dot?", f"{colour.capitalize()}.", "videos", name)]
    for split, rows in splits.items():
        rng.shuffle(rows)
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
        print(f"{split}: {len(rows)} rows")


if __name__ == "__main__":
    build()
