"""Reading slices of a Hugging Face safetensors checkpoint, and writing one as shards plus an index.

`SafetensorsReader` reads the shards' headers once, then only the rows (or, for row-parallel weights, the
columns, through one tensor at a time) that a rank holds, so a tensor-parallel rank never materializes
the tensors it does not hold.
`ShardWriter` lays out size-capped shards from a plan of (name, shape, dtype) and writes each tensor into
its place as it is produced; `finish_shards` names them and writes `model.safetensors.index.json` (or a
single `model.safetensors`) the way `from_pretrained` expects.
"""
from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}


@dataclass(frozen=True)
class _Entry:
    file: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # absolute byte offset of the tensor's data in its file


def _read_header(path: Path) -> dict[str, dict]:
    with open(path, "rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(length))
    header.pop("__metadata__", None)
    for entry in header.values():
        entry["data_start"] = 8 + length
    return header


class SafetensorsReader:
    """Name → (file, dtype, shape, offset) over a checkpoint directory, with sliced reads.

    Reads use plain positioned file reads (`os.preadv`) straight into the destination tensor, not a memory
    map: a mapped file's touched pages count as the reader's resident memory, so mapping a whole
    checkpoint would make each rank's RSS the size of the files it read.
    """

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        index = self.directory / INDEX_NAME
        if index.exists():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        elif (self.directory / SINGLE_NAME).exists():
            files = [SINGLE_NAME]
        else:
            raise FileNotFoundError(f"{self.directory} has neither {INDEX_NAME} nor {SINGLE_NAME}: not a "
                                    "Hugging Face safetensors checkpoint.")
        self.entries: dict[str, _Entry] = {}
        for file in files:
            for name, entry in _read_header(self.directory / file).items():
                self.entries[name] = _Entry(file, _DTYPES[entry["dtype"]], tuple(entry["shape"]),
                                            entry["data_start"] + entry["data_offsets"][0])
        self._fds: dict[str, int] = {}

    @property
    def files(self) -> dict[str, str]:
        return {name: entry.file for name, entry in self.entries.items()}

    def names(self) -> set[str]:
        return set(self.entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.entries[name].shape

    def _fd(self, file: str) -> int:
        if file not in self._fds:
            self._fds[file] = os.open(self.directory / file, os.O_RDONLY)
        return self._fds[file]

    def _read_rows(self, entry: _Entry, start: int, out: torch.Tensor) -> None:
        """Rows [start, start + len(out)) straight into the contiguous tensor `out` (of the file's dtype)."""
        row = math.prod(entry.shape[1:]) * _itemsize(entry.dtype)
        buffer = memoryview(out.view(torch.uint8).numpy()).cast("B") if out.numel() else memoryview(b"")
        done, fd = 0, self._fd(entry.file)
        while done < len(buffer):  # a positioned read may return fewer bytes than asked
            got = os.preadv(fd, [buffer[done:]], entry.offset + start * row + done)
            if got == 0:
                raise OSError(f"{self.directory / entry.file}: file ends inside tensor data")
            done += got

    def read_rows_into(self, name: str, out: torch.Tensor, start: int = 0) -> None:
        """Rows [start, start + len(out)) of tensor `name` into `out` (no copy when the dtypes agree)."""
        entry = self.entries[name]
        if out.dtype == entry.dtype and out.is_contiguous():
            self._read_rows(entry, start, out.view(out.shape[0], *entry.shape[1:]) if entry.shape else out)
        else:
            out.copy_(self.read(name, 0, start, start + out.shape[0]).view(out.shape))

    def read(self, name: str, dim: int | None = None, start: int = 0, stop: int = 0) -> torch.Tensor:
        """The whole tensor (dim None), or rows (dim 0) / columns (dim 1) [start, stop) of it."""
        entry = self.entries[name]
        if dim == 0:
            out = torch.empty((stop - start, *entry.shape[1:]), dtype=entry.dtype)
            self._read_rows(entry, start, out)
            return out
        whole = torch.empty(entry.shape, dtype=entry.dtype)
        self._read_rows(entry, 0, whole.view(-1, *entry.shape[1:]) if entry.shape else whole.view(1))
        return whole if dim is None else whole[:, start:stop].contiguous()

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


_DTYPE_NAMES = {dtype: name for name, dtype in _DTYPES.items()}


class ShardWriter:
    """Writes a planned list of tensors into safetensors shards of at most `max_shard_bytes`, one at a time.

    The plan (name, shape, dtype, in writing order) is known before any tensor exists, so each shard's
    header, with every tensor's offset, is written first and each tensor then goes straight to its place
    (`os.pwrite`): memory stays at the one tensor being written, whatever the shard size. A tensor larger
    than the limit gets a shard of its own.
    """

    def __init__(self, directory: Path, plan: list[tuple[str, tuple[int, ...], torch.dtype]], prefix: str = "model",
                 max_shard_bytes: int = 2 * 1024**3):
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        self.weight_map: dict[str, str] = {}  # tensor name → shard file
        self.total_bytes = 0
        self._where: dict[str, tuple[int, int, tuple[int, ...], torch.dtype]] = {}  # name → fd, offset, shape, dtype
        self._fds: list[int] = []
        for part, entries in enumerate(_split(plan, max_shard_bytes)):
            self._open_shard(f"{prefix}-part{part:05d}.safetensors", entries)

    def _open_shard(self, file: str, entries: list[tuple[str, tuple[int, ...], torch.dtype]]) -> None:
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for name, shape, dtype in entries:
            size = math.prod(shape) * _itemsize(dtype)
            header[name] = {"dtype": _DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
            offset += size
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
        fd = os.open(self.directory / file, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        os.write(fd, struct.pack("<Q", len(text)) + text)
        os.ftruncate(fd, 8 + len(text) + offset)
        self._fds.append(fd)
        for name, shape, dtype in entries:
            self._where[name] = (fd, 8 + len(text) + header[name]["data_offsets"][0], shape, dtype)
            self.weight_map[name] = file
        self.total_bytes += offset

    def write(self, name: str, tensor: torch.Tensor) -> None:
        fd, offset, shape, dtype = self._where[name]
        if tuple(tensor.shape) != shape or tensor.dtype != dtype:
            raise ValueError(f"tensor {name!r}: planned {list(shape)} {dtype}, got {list(tensor.shape)} {tensor.dtype}")
        data = memoryview(tensor.detach().contiguous().view(torch.uint8).numpy()).cast("B")
        while len(data):
            written = os.pwrite(fd, data, offset)
            data, offset = data[written:], offset + written

    def close(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds.clear()


def _split(plan, max_shard_bytes: int) -> list[list]:
    shards, current, size = [], [], 0
    for entry in plan:
        nbytes = math.prod(entry[1]) * _itemsize(entry[2])
        if current and size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(entry)
        size += nbytes
    return shards + [current] if current else shards


def finish_shards(directory: Path, weight_map: dict[str, str], total_bytes: int) -> list[str]:
    """Rename the written parts to `model-0000k-of-0000n.safetensors` and write the index; the file names.

    One part becomes `model.safetensors` with no index, as `save_pretrained` writes a small model.
    """
    parts = sorted(set(weight_map.values()))
    if len(parts) == 1:
        names = {parts[0]: SINGLE_NAME}
    else:
        names = {part: f"model-{k + 1:05d}-of-{len(parts):05d}.safetensors" for k, part in enumerate(parts)}
    for part, final in names.items():
        os.replace(directory / part, directory / final)
    if len(parts) > 1:
        index = {"metadata": {"total_size": total_bytes},
                 "weight_map": {name: names[part] for name, part in sorted(weight_map.items())}}
        (directory / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    return sorted(names.values())
