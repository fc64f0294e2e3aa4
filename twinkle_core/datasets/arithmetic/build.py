"""Builds the bundled arithmetic set (train.jsonl, heldout.jsonl) for the grpo flow, from a fixed seed.

    python -m twinkle_core.datasets.arithmetic.build

Each row asks for the sum of two whole numbers from 1 to 20, in one of a few phrasings, and holds the
answer as `solution`: {"prompt": "What is 7 + 12?", "solution": "19"}. The numeric_match reward compares
the last number of a completion with it. Train and heldout use disjoint pairs of numbers. Standard library
only.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

SEED = 20261204
HERE = Path(__file__).resolve().parent
PHRASINGS = ["What is {a} + {b}?", "What is {a} plus {b}?", "Add {a} and {b}.", "Compute {a} + {b}.",
             "{a} + {b} = ?", "What do you get when you add {a} to {b}?"]
SUFFIX = " Reply with the sum only."
HELDOUT = 64


def build() -> None:
    rng = random.Random(SEED)
    pairs = [(a, b) for a in range(1, 21) for b in range(1, 21)]
    rng.shuffle(pairs)
    splits = {"heldout": pairs[:HELDOUT], "train": pairs[HELDOUT:]}
    for split, chosen in splits.items():
        rows = [{"prompt": rng.choice(PHRASINGS).format(a=a, b=b) + SUFFIX, "solution": str(a + b)} for a, b in chosen]
        (HERE / f"{split}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
        print(f"{split}: {len(rows)} prompts")


if __name__ == "__main__":
    build()
