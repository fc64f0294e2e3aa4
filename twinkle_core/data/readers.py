"""Read the records of a data file (.jsonl, .json, .parquet) with their 1-based line or row numbers."""
from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any, Iterable, Iterator

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
    for number, raw in _jsonl_lines(path):
        yield number, parse_record(raw)


def _jsonl_lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """(number, raw line) of every non-blank line; blank lines (often a trailing newline) are not rows."""
    with open(path, "rb") as handle:  # decoded line by line: one bad byte costs its row, not the file
        for number, raw in enumerate(handle, start=1):
            if raw.strip():
                yield number, raw


def parse_record(record: Any) -> Any:
    """A record as read_records gives it: raw .jsonl bytes are decoded and parsed here (a RowError if they
    cannot be); records of other files are already parsed and pass through."""
    if not isinstance(record, bytes):
        return record
    try:
        line = record.decode("utf-8")
    except UnicodeDecodeError as error:
        return RowError(f"not UTF-8 text (byte {error.start + 1} of the line is {record[error.start]:#04x})")
    try:
        return json.loads(line)
    except json.JSONDecodeError as error:
        return RowError(f"invalid JSON: {error}")


def read_record_chunks(path: Path, rows: int) -> Iterator[list[tuple[int, Any]]]:
    """read_records in lists of at most `rows` records, for worker processes: .jsonl lines stay raw bytes, so
    the workers parse them (parse_record) and the reader only splits lines."""
    records = _jsonl_lines(path) if path.is_file() and path.suffix.lower() == ".jsonl" else read_records(path)
    return chunked(records, rows)


def chunked(items: Iterable, size: int) -> Iterator[list]:
    """Lists of `size` consecutive items (the last may be shorter), read lazily."""
    items = iter(items)
    while chunk := list(itertools.islice(items, size)):
        yield chunk


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
