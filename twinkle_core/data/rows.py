"""Load a data file into validated rows, skipping and reporting the bad ones."""
from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

from .errors import DatasetError, RowError
from .formats import get_row_format
from .readers import parse_record, read_records

logger = logging.getLogger(__name__)

LOGGED_BAD_ROWS = 10  # how many bad rows a warning or an error spells out
# Where rows that carry these keys train, for a kind that ignores them.
_TRAIN_ELSEWHERE = {
    **dict.fromkeys(("chosen", "rejected", "rejected_response"), "preference pairs train with the dpo flow"),
    **dict.fromkeys(("prompt", "solution"), "prompts and their reward fields train with the grpo flow"),
}


@dataclass(frozen=True)
class BadRow:
    """A skipped row: its file, its line (row number for .json lists and parquet, 1-based) and why."""

    file: str
    line: int
    reason: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.reason}"


@dataclass
class LoadedRows:
    """Good rows (normalised), their line numbers, and the bad rows that were skipped."""

    rows: list[dict] = field(default_factory=list)
    lines: list[int] = field(default_factory=list)
    bad: list[BadRow] = field(default_factory=list)


def _empty(value: Any) -> bool:
    return value is None or (isinstance(value, (str, list, dict)) and not value)


def _ignored_key(key: str, count: int) -> str:
    hint = f": {_TRAIN_ELSEWHERE[key]}" if key in _TRAIN_ELSEWHERE else ""
    return f"{key!r} ({count} row{'' if count == 1 else 's'}{hint})"


@dataclass
class UnreadKeys:
    """The top-level keys of good rows that their kind does not read (training ignores them), as counted."""

    rows: int = 0  # rows carrying any
    keys: Counter = field(default_factory=Counter)  # each key: the rows carrying it

    def count(self, record: dict, known: frozenset[str]) -> None:
        # A null or empty value holds nothing to lose: parquet gives a row null for a column other rows have.
        unread = [key for key, value in record.items() if key not in known and not _empty(value)]
        self.rows += bool(unread)
        self.keys.update(unread)

    def add(self, other: UnreadKeys) -> None:
        self.rows += other.rows
        self.keys.update(other.keys)


@dataclass(frozen=True)
class IgnoredFields:
    """What `rows_read` rows of `kind` carry that training ignores: keys the kind does not read (`keys`, each with
    the rows carrying it, most first; `rows` carry any), and tool schemas the chat template does not render."""

    kind: str
    rows_read: int
    rows: int = 0
    keys: tuple[tuple[str, int], ...] = ()
    tools_rows: int = 0  # rows whose tools the template drops

    def warnings(self, source: str) -> list[str]:
        """One line per kind of loss, naming `source`; empty when nothing is ignored."""
        out = []
        if self.keys:
            listing = ", ".join(_ignored_key(key, count) for key, count in self.keys)
            out.append(f"{source}: {self.rows} of {self.rows_read} rows carry fields the {self.kind} rows do not use, "
                       f"ignored: {listing}")
        if self.tools_rows:
            out.append(f"{source}: {self.tools_rows} of {self.rows_read} rows carry 'tools', but the chat template of "
                       "this model renders no tool schemas: they train without them")
        return out


def load_rows(path: str | Path, kind: str = "chat", max_bad_fraction: float = 0.01) -> LoadedRows:
    """Read and validate every row of a .jsonl, .json or .parquet file.

    Raises DatasetError when more than `max_bad_fraction` of the rows are bad, and always when none is good.
    """
    check_fraction(max_bad_fraction)
    row_format = get_row_format(kind)
    path = Path(path)
    loaded = LoadedRows()
    for number, row in check_records(read_records(path), row_format, str(path), path.parent, loaded.bad):
        loaded.rows.append(row)
        loaded.lines.append(number)
    report_bad_rows(loaded.bad, len(loaded.rows) + len(loaded.bad), max_bad_fraction, str(path))
    return loaded


def check_records(records: Iterable[tuple[int, Any]], row_format, source: str, folder: Path | None,
                  bad: list[BadRow], unread: UnreadKeys | None = None) -> Iterator[tuple[int, dict]]:
    """(number, validated row) of every good record; each bad one (a RowError as read, raw .jsonl bytes that do
    not parse, or a row the kind refuses) goes to `bad` with its number. `unread` counts the keys of the good
    records that the kind does not read (on the record: some validators keep only the keys they read)."""
    for number, record in records:
        try:
            record = parse_record(record)
            if isinstance(record, RowError):
                raise record
            row = row_format.check(record, folder)
        except RowError as error:
            bad.append(BadRow(source, number, str(error)))
            continue
        if unread is not None and row_format.fields is not None:
            unread.count(record, row_format.fields)
        yield number, row


def check_fraction(max_bad_fraction: float) -> None:
    """Reject a threshold outside [0, 1] before any work is done."""
    if not 0.0 <= max_bad_fraction <= 1.0:
        raise ValueError(f"max_bad_fraction={max_bad_fraction!r} must be between 0 and 1 (e.g. 0.01 for 1%)")


def _listing(bad: list[BadRow], num_bad: int) -> str:
    lines = [f"  {row}" for row in bad[:LOGGED_BAD_ROWS]]
    if num_bad > len(lines):
        lines.append(f"  ... and {num_bad - len(lines)} more")
    return "\n".join(lines)


def report_bad_rows(
    bad: list[BadRow], total: int, max_bad_fraction: float, source: str, num_bad: int | None = None
) -> None:
    """Warn about skipped rows; raise DatasetError above the threshold or when no row is left.

    `num_bad` is the true count when `bad` is a truncated listing.
    """
    num_bad = len(bad) if num_bad is None else num_bad
    if total == 0:
        raise DatasetError(f"{source} has no rows; it needs at least one")
    if num_bad >= total:
        raise DatasetError(f"{source}: none of its {total} rows is usable:\n{_listing(bad, num_bad)}")
    if num_bad == 0:
        return
    if num_bad > max_bad_fraction * total:
        raise DatasetError(
            f"{source}: {num_bad} of {total} rows are bad ({num_bad / total:.1%}), more than "
            f"max_bad_fraction={max_bad_fraction}:\n{_listing(bad, num_bad)}\n"
            "Fix these rows, or raise max_bad_fraction to skip them."
        )
    logger.warning("%s: skipping %d bad rows of %d:\n%s", source, num_bad, total, _listing(bad, num_bad))
