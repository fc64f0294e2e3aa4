"""A model folder checked before anything loads it: its weight files whole, its tokenizer there.

A damaged folder (a shard missing, a truncated download, a corrupt header, the tokenizer files left behind)
otherwise fails deep inside transformers with a traceback, or with a misleading hint ("You need to have
sentencepiece or tiktoken installed" for a missing tokenizer.json). The checks read only what is cheap: the
safetensors index, each file's 8-byte header length and JSON header, and the file size the header implies.
"""
from __future__ import annotations

import json
import struct
from pathlib import Path

from .errors import HubError

INDEX = "model.safetensors.index.json"
# What a tokenizer is read from: a fast tokenizer's JSON, sentencepiece/tiktoken models, BPE or WordPiece vocabularies.
TOKENIZER_PATTERNS = ("tokenizer.json", "*.model", "*.tiktoken", "vocab.json", "vocab.txt", "*.vocab")


def safetensors_problem(path: Path) -> str | None:
    """What is wrong with one safetensors file (None: its header reads and its size covers every tensor)."""
    size = path.stat().st_size
    if size < 8:
        return f"{path.name} is {size} bytes: truncated (not even a header)"
    with path.open("rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        if length > size - 8:
            return f"{path.name}: its header claims {length} bytes but the file has {size}: truncated or not safetensors"
        try:
            header = json.loads(handle.read(length))
        except (ValueError, UnicodeDecodeError):
            return f"{path.name}: the header is not readable JSON (corrupted)"
    ends = [entry["data_offsets"][1] for name, entry in header.items()
            if name != "__metadata__" and isinstance(entry, dict) and "data_offsets" in entry]
    needed = 8 + length + max(ends, default=0)
    if size < needed:
        return f"{path.name} is {size:,} bytes, its tensors need {needed:,}: truncated (an interrupted download?)"
    return None


def model_folder_problems(folder: str | Path) -> list[str]:
    """Every problem of a Hugging Face model folder's weights and tokenizer files."""
    folder = Path(folder)
    problems = []
    index = folder / INDEX
    files = sorted(folder.glob("*.safetensors"))
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError):
            problems.append(f"{INDEX} is not a readable safetensors index (no weight_map)")
            shards = []
        missing = [name for name in shards if not (folder / name).is_file()]
        if missing:
            problems.append(f"{len(missing)} of the {len(shards)} weight files {INDEX} lists are missing: "
                            f"{', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}")
    problems += [problem for path in files if (problem := safetensors_problem(path))]
    if (folder / "config.json").is_file() and not any(any(folder.glob(p)) for p in TOKENIZER_PATTERNS):
        problems.append("no tokenizer files (tokenizer.json, a sentencepiece/tiktoken .model, or vocab.json / "
                        "vocab.txt): copy them from the original model")
    return problems


def check_model_folder(folder: str | Path, model_id: str) -> None:
    """Raise one HubError naming the folder and every damaged or missing file."""
    problems = model_folder_problems(folder)
    if problems:
        where = f"model id {model_id!r}" + ("" if str(folder) == model_id else f" ({folder})")
        raise HubError(f"{where} is damaged: " + "; ".join(problems) + ". Download or copy it again.")
