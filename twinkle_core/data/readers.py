"""Read the records of a data file (.jsonl, .json, .parquet) with their 1-based line or row numbers."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import pyarrow.parquet as pq

from .errors import DatasetError, RowError

SUFFIXES = (".jsonl", ".json", ".parquet")


def read_records(path: Path) -> Iterator[tuple[int, Any]]:
    """Yield (number, record); a record that cannot be parsed is yielded as a RowError."""
    if not path.is_file():
        raise DatasetError(f"dataset file {str(path)!r} does not exist or is not a file")
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        return _read_jsonl(path)
    if suffix == ".json":
        return _read_json_list(path)
    if suffix == ".parquet":
        return _read_parquet(path)
    raise DatasetError(f"dataset file {str(path)!r} has suffix {suffix!r}; supported: {', '.join(SUFFIXES)}")


def _read_jsonl(path: Path) -> Iterator[tuple[int, Any]]:
    with open(path, "rb") as handle:  # decoded line by line: one bad byte costs its row, not the file
        for number, raw in enumerate(handle, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                yield number, RowError(f"not UTF-8 text (byte {error.start + 1} of the line is {raw[error.start]:#04x})")
                continue
            if not line.strip():
                continue  # blank lines (often a trailing newline) are not rows
            try:
                yield number, json.loads(line)
            except json.JSONDecodeError as error:
                yield number, RowError(f"invalid JSON: {error}")


def _read_json_list(path: Path) -> Iterator[tuple[int, Any]]:
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        line = data.count(b"\n", 0, error.start) + 1
        raise DatasetError(f"{path} is not UTF-8 text: byte {data[error.start]:#04x} on line {line}; a .json dataset "
                           "is read whole (a .jsonl file loses only the bad rows)") from None
    try:
        records = json.loads(text)
    except json.JSONDecodeError as error:
        raise DatasetError(f"{path} is not valid JSON ({error}); a .json dataset is one list of row objects") from None
    if not isinstance(records, list):
        raise DatasetError(
            f"{path} holds a JSON {type(records).__name__}; a .json dataset must be a list of row objects "
            "(use .jsonl for one object per line)"
        )
    yield from enumerate(records, start=1)


def _read_parquet(path: Path) -> Iterator[tuple[int, Any]]:
    parquet = pq.ParquetFile(path)
    number = 0
    for batch in parquet.iter_batches():
        for record in batch.to_pylist():
            number += 1
            yield number, record
