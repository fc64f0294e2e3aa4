"""Read a dataset as a stream of rows, for sets that should not be copied to the local disk first.

`open_stream(dataset_id)` gives the rows of a hub split (`hf://`, `ms://`) or of a local data file one at a time,
through HF datasets' streaming loaders (`load_dataset(..., streaming=True)`), with a content key that names
them without reading them: a Hugging Face commit, a ModelScope snapshot's files, or a local file's sha256.
tokenize_stream (twinkle_core.data) encodes them as they arrive; nothing but the tokenised rows is written.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from twinkle_core.hashing import hash_file, hash_json

from .errors import HubError
from .ids import is_offline, parse_id
from .local import local_target
from .snapshots import download_snapshot, snapshot_hash

_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


@dataclass(frozen=True)
class StreamedDataset:
    """A dataset read row by row: `source` and `options` go to datasets.load_dataset(streaming=True)."""

    dataset_id: str
    source: str
    options: tuple[tuple[str, Any], ...]
    content_hash: str

    def records(self) -> Iterator[tuple[int, dict]]:
        """(row number from 1, row) in the split's order."""
        import datasets

        try:
            rows = datasets.load_dataset(self.source, streaming=True, **dict(self.options))
            yield from enumerate(rows, start=1)
        except (datasets.exceptions.DatasetsError, FileNotFoundError, ConnectionError) as exc:
            raise HubError(f"dataset id {self.dataset_id!r}: could not stream {self.source!r}: {exc}") from exc


def open_stream(dataset_id: str) -> StreamedDataset:
    """The stream of `dataset_id`: a hub split (`hf://org/name[@rev][:split]`, split train by default), or a
    local .jsonl / .json / .parquet file (the same loaders, for tests and for files on a network mount)."""
    parsed = parse_id(dataset_id)
    if parsed.scheme in ("hf", "ms"):
        split = parsed.split or "train"
        if parsed.scheme == "hf" and not is_offline():
            from huggingface_hub import HfApi

            commit = HfApi().dataset_info(parsed.name, revision=parsed.revision).sha  # pins the rows
            key = hash_json({"hub": "hf", "repo": parsed.name, "commit": commit, "split": split})
            return StreamedDataset(dataset_id, parsed.name, (("split", split), ("revision", commit)), key)
        folder = download_snapshot(parsed, dataset_id, "dataset")
        key = hash_json({"snapshot": snapshot_hash(parsed, folder), "split": split})
        return StreamedDataset(dataset_id, str(folder), (("split", split),), key)
    path = local_target(parsed, dataset_id)
    if not path.is_file() or path.suffix.lower() not in _BUILDERS:
        raise HubError(f"dataset id {dataset_id!r}: streaming reads a hub split or one local "
                       f"{'/'.join(_BUILDERS)} file; {str(path)!r} is neither")
    return StreamedDataset(dataset_id, _BUILDERS[path.suffix.lower()],
                           (("data_files", str(Path(path).resolve())), ("split", "train")), hash_file(path))
