"""Tokenised rows on disk: written a chunk at a time, read lazily through a memory map.

The rows of a tokenised set are one Arrow IPC file (`data.arrow`, uncompressed), so a training worker opens it
without reading it: `TokenizedRows` maps the file and turns only the rows it is asked for into Python values.
The pages it touches are the file's own (the page cache, shared by every rank on the machine), so a worker's
memory for the data does not grow with the data set. Lengths come from the list offsets, without a row read.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa

from .errors import DatasetError

ROWS_FILE = "data.arrow"
# Columns whose type a chunk cannot tell when all its values are empty lists (no hard negatives, no video).
NESTED_INT_COLUMNS = frozenset({"negative_ids", "image_grid_thw", "video_grid_thw"})
FLOAT_LIST_COLUMNS = frozenset({"pixel_values", "pixel_values_videos", "second_per_grid_ts"})


def column_type(name: str, values: list) -> pa.DataType:
    """int32 token lists, or lists of them (an embedding row's hard negatives or a vision row's media grids), or
    numbers (a preference pair's reference log-probs), or float32 lists (a vision row's pixel patches), or text
    (a prompt row's text and fields)."""
    if name in NESTED_INT_COLUMNS:
        return pa.list_(pa.list_(pa.int32()))
    if name in FLOAT_LIST_COLUMNS:
        return pa.list_(pa.float32())
    if values and isinstance(values[0], float):
        return pa.float64()
    if any(value and isinstance(value[0], float) for value in values if isinstance(value, list)):
        return pa.list_(pa.float32())
    if values and isinstance(values[0], str):
        return pa.string()
    nested = any(value and isinstance(value[0], list) for value in values)
    return pa.list_(pa.list_(pa.int32())) if nested else pa.list_(pa.int32())


def _fields_differ(first: list[str], other: list[str]) -> DatasetError:
    differ = sorted(set(first) ^ set(other))
    return DatasetError(f"the rows differ in their fields: {differ} on some rows and not on others; give each "
                        "optional field (reference log-probs, a reward's field) on every row or on none")


def _flat(value):
    return value.tolist() if isinstance(value, np.ndarray) else value


def record_batch(rows: list[dict]) -> pa.RecordBatch:
    """The rows (dicts with the same keys) as one Arrow record batch, typed by column_type."""
    names = list(rows[0])
    for row in rows:
        if row.keys() != rows[0].keys():
            raise _fields_differ(names, list(row))
    arrays, built = [], []
    for name in names:
        values = [_flat(row[name]) for row in rows]
        kind = column_type(name, values)
        # A column equal to an earlier one (a text row's labels are its input_ids) reuses its array: the same
        # data, converted once.
        array = next((array for earlier, array in built if array.type == kind and earlier == values), None)
        if array is None:
            array = pa.array(values, type=kind)
            built.append((values, array))
        arrays.append(array)
    return pa.record_batch(arrays, names=names)


class RowWriter:
    """Appends rows (dicts of lists) to an Arrow IPC file; the first rows fix the columns and their types."""

    def __init__(self, path: Path):
        self.path, self.num_rows = Path(path), 0
        self._sink = self._writer = self._schema = None

    def write(self, rows: list[dict]) -> None:
        if rows:
            self.write_batch(record_batch(rows))

    def write_batch(self, batch: pa.RecordBatch) -> None:
        """Append a record batch; a later batch whose types differ (a column empty in it) is cast to the first's."""
        if self._writer is None:
            self._schema = batch.schema
            self._sink = pa.OSFile(str(self.path), "wb")
            self._writer = pa.ipc.new_file(self._sink, self._schema)
        if set(batch.schema.names) != set(self._schema.names):
            raise _fields_differ(self._schema.names, batch.schema.names)
        if batch.schema != self._schema:
            batch = batch.cast(self._schema)
        self._writer.write_batch(batch)
        self.num_rows += batch.num_rows

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._sink.close()


class TokenizedRows(Sequence):
    """The rows of a tokenised set, read on demand: `rows[i]` is a dict of int lists (float lists as float32
    numpy arrays), `rows[a:b]` a list of them; `meta` is the set's meta.json."""

    def __init__(self, path: str | Path):
        path = Path(path)
        self.path = path
        self.meta = json.loads((path / "meta.json").read_text())
        self._table = pa.ipc.open_file(pa.memory_map(str(path / ROWS_FILE))).read_all()  # maps, reads nothing
        self._floats = [field.name for field in self._table.schema
                        if pa.types.is_list(field.type) and pa.types.is_floating(field.type.value_type)]

    def __len__(self) -> int:
        return self._table.num_rows

    def __getitem__(self, index):
        if isinstance(index, slice):
            return self._rows(*index.indices(len(self))[:2]) if (index.step or 1) == 1 else [
                self[i] for i in range(*index.indices(len(self)))]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"row {index} of {len(self)}")
        return self._rows(index, index + 1)[0]

    def __iter__(self):
        for start in range(0, len(self), 1024):  # a block at a time: one Arrow conversion per block
            yield from self._rows(start, min(start + 1024, len(self)))

    def _rows(self, start: int, stop: int) -> list[dict]:
        if stop <= start:
            return []
        part = self._table.slice(start, stop - start)
        rows = part.drop_columns(self._floats).to_pylist() if self._floats else part.to_pylist()
        for name in self._floats:
            column = part.column(name).combine_chunks()
            offsets, values = column.offsets.to_numpy(), column.values.to_numpy()
            for row, begin, end in zip(rows, offsets[:-1], offsets[1:]):
                row[name] = values[begin:end]
        return rows

    def lengths(self, column: str = "input_ids") -> np.ndarray:
        """The number of items of `column` in every row, from the list offsets (no row is read)."""
        column = self._table.column(column)
        return np.concatenate([np.diff(chunk.offsets.to_numpy()) for chunk in column.chunks]) if column.chunks \
            else np.zeros(0, dtype=np.int64)
