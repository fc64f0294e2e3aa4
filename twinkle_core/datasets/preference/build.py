"""Builds the bundled preference set (train.jsonl, heldout.jsonl) from the self-cognition set, byte for byte.

    python -m twinkle_core.datasets.preference.build

Each self-cognition row becomes a pair: its conversation up to the last user turn is the prompt, its
Twinkle answer is `chosen`, and the same sentence as the default model (SmolLM2-135M-Instruct) would say
it, "SmolLM, trained by Hugging Face", is `rejected`. Chosen and rejected differ only in who the assistant
is, so the model can only win by learning that preference, and the base model starts out preferring the
rejected reply. Train and heldout keep the self-cognition split (no held-out prompt appears in train).
Standard library only.
"""
from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCE = HERE.parent / "self_cognition"

# Longest first, so "Twinkle Flows team" is replaced before "Twinkle".
BASE_IDENTITY = [("the Twinkle Flows team", "Hugging Face"), ("Twinkle", "SmolLM"), ("built by", "trained by"),
                 ("I was built", "I was trained"), ("their AI assistant", "its AI assistant")]


def as_base_model(reply: str) -> str:
    """The Twinkle reply, said as the base model describes itself."""
    for ours, theirs in BASE_IDENTITY:
        reply = reply.replace(ours, theirs)
    return reply


def pair(row: dict) -> dict:
    *prompt, answer = row["messages"]
    rejected = as_base_model(answer["content"])
    assert rejected != answer["content"], answer
    return {"messages": prompt, "chosen": answer["content"], "rejected": rejected}


def build() -> None:
    for split in ("train", "heldout"):
        rows = [json.loads(line) for line in (SOURCE / f"{split}.jsonl").read_text().splitlines() if line.strip()]
        text = "".join(json.dumps(pair(row), ensure_ascii=False) + "\n" for row in rows)
        (HERE / f"{split}.jsonl").write_text(text)
        print(f"{split}: {len(rows)} pairs")


if __name__ == "__main__":
    build()
