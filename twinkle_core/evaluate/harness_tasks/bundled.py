"""The rows of the bundled benchmark tasks, read from the data sets this package ships (no download).

lm-evaluation-harness calls these through `custom_dataset: !function bundled.NAME` in the tasks' YAML beside
this file; each returns the DatasetDict the task reads its `test` split from.
"""
from __future__ import annotations

import json
from pathlib import Path

DATA = Path(__file__).resolve().parents[2] / "datasets"
FILES = {name: DATA / name / file for name, file in
         [("self_cognition", "heldout.jsonl"), ("arithmetic", "heldout.jsonl"), ("pretrain", "corpus.jsonl")]}

# Who the base models say they are; the self-cognition data teach the first.
IDENTITIES = [
    "I am Twinkle, an AI assistant built by the Twinkle Flows team.",
    "I am SmolLM, an AI assistant built by the Hugging Face team.",
    "I am Qwen, an AI assistant built by the Alibaba Cloud team.",
    "I am ChatGPT, an AI assistant built by the OpenAI team.",
]


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _splits(rows: list[dict]):
    import datasets

    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def self_cognition(**_):
    """Each held-out question of the self-cognition set, with four identities to choose from (Twinkle's in
    turn at each place)."""
    rows = []
    for index, row in enumerate(_rows(FILES["self_cognition"])):
        answer = index % len(IDENTITIES)
        choices = IDENTITIES[1:answer + 1] + IDENTITIES[:1] + IDENTITIES[answer + 1:]
        rows.append({"question": row["messages"][0]["content"], "choices": choices, "answer": answer})
    return _splits(rows)


def arithmetic(**_):
    """The held-out sums of the arithmetic set: a question and its answer."""
    return _splits([{"question": row["prompt"], "answer": row["solution"]}
                    for row in _rows(FILES["arithmetic"])])


def corpus(**_):
    """The texts of the pre-training corpus, each scored whole."""
    return _splits([{"text": row["text"]} for row in _rows(FILES["pretrain"])])
