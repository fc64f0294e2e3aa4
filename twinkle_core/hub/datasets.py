"""Resolve a dataset id to one local data file (.jsonl, .json or .parquet) and its sha256."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from twinkle_core.atomic import atomic_dir
from twinkle_core.hashing import hash_file, hash_json
from twinkle_core.paths import cache_dir

from .errors import HubError
from .ids import ParsedId, is_offline, parse_id
from .local import id_problems, local_target
from .snapshots import download_snapshot

log = logging.getLogger(__name__)

DATA_SUFFIXES = (".jsonl", ".json", ".parquet")


@dataclass(frozen=True)
class ResolvedDataset:
    """A dataset as one local file."""

    dataset_id: str
    path: Path  # one local file: .jsonl, .json or .parquet
    content_hash: str  # sha256 of that file's bytes


def resolve_dataset(dataset_id: str) -> ResolvedDataset:
    """Resolve a local file or folder, `pkg://`, or `hf://` / `ms://org/name[@revision][:split]` (split: train)."""
    parsed = parse_id(dataset_id)
    if parsed.scheme in ("hf", "ms"):
        path = _materialise_hub_dataset(parsed, dataset_id)
    else:
        path = _local_data_file(local_target(parsed, dataset_id), dataset_id)
    return ResolvedDataset(dataset_id, path, hash_file(path))


def dataset_problems(field: str, text: str) -> list[str]:
    """What is wrong with a dataset id before the run: id_problems, and what resolve_dataset would refuse in a
    local file from its name and size alone (its rows are read once, in the run)."""
    problems = id_problems(field, text)
    parsed = None if problems else parse_id(text)
    if parsed is None or parsed.scheme not in ("local", "pkg"):
        return problems
    try:
        _local_data_file(local_target(parsed, text), text)
    except HubError as err:
        return [f"{field}={text!r}: {str(err).removeprefix(f'dataset id {text!r}: ')}"]
    return []


def _local_data_file(target: Path, dataset_id: str) -> Path:
    """The data file a local path names: the file itself, or the one data file of a folder; not empty."""
    path = target if target.is_file() else _single_data_file(target, dataset_id)
    if path.suffix.lower() not in DATA_SUFFIXES:
        raise HubError(f"dataset id {dataset_id!r}: {str(path)!r} is not one of {', '.join(DATA_SUFFIXES)}; "
                       "convert it to one of those")
    if path.stat().st_size == 0:
        raise HubError(f"dataset id {dataset_id!r}: {str(path)!r} is empty (0 bytes): it has no rows")
    return path


def _single_data_file(folder: Path, dataset_id: str) -> Path:
    """The one data file inside `folder` (hidden folders such as .cache are skipped)."""
    found = sorted(
        p
        for p in folder.rglob("*")
        if p.is_file() and p.suffix.lower() in DATA_SUFFIXES and not _hidden(p.relative_to(folder))
    )
    if len(found) != 1:
        names = [p.relative_to(folder).as_posix() for p in found[:20]]
        raise HubError(
            f"dataset id {dataset_id!r}: folder {str(folder)!r} must hold exactly one {'/'.join(DATA_SUFFIXES)} "
            f"file, found {len(found)}: {names}; name the file itself instead"
        )
    return found[0]


def _hidden(relative: Path) -> bool:
    return any(part.startswith(".") for part in relative.parts)


def _materialise_hub_dataset(parsed: ParsedId, dataset_id: str) -> Path:
    """Load the split and write it once to the Twinkle cache as data.parquet."""
    split = parsed.split or "train"
    dataset = _load_hub_split(parsed, dataset_id, split)
    # _fingerprint is the datasets library's own key for the loaded table: it follows the exact source
    # files (snapshot paths hold the commit), so '@main' and '@<that commit>' share one cache entry.
    key = hash_json({"id": f"{parsed.scheme}://{parsed.name}", "split": split, "fingerprint": dataset._fingerprint})
    final = cache_dir("datasets") / f"{parsed.scheme}-{parsed.name.replace('/', '--')}-{key[:16]}"
    target = final / "data.parquet"
    if not target.is_file():
        log.info("writing %s (%d rows) to %s", dataset_id, len(dataset), target)
        with atomic_dir(final) as tmp:
            dataset.to_parquet(tmp / target.name)
    return target


def _load_hub_split(parsed: ParsedId, dataset_id: str, split: str):
    """Load one split as a `datasets.Dataset`.

    Online hf:// ids go through `load_dataset(name)`, which fetches only the files it needs into the
    Hugging Face hub cache. Offline, `load_dataset(name)` ignores that cache, and `MsDataset.load` always
    queries ModelScope first, so both hubs then load the cached repo snapshot as a local folder.
    """
    import datasets
    from datasets.exceptions import DatasetsError

    arrow_cache = str(cache_dir("datasets") / "arrow")
    if parsed.scheme == "hf" and not is_offline():
        source, extra = parsed.name, {"revision": parsed.revision}
    else:
        source, extra = str(download_snapshot(parsed, dataset_id, "dataset")), {}
    try:
        return datasets.load_dataset(source, split=split, cache_dir=arrow_cache, **extra)
    except (DatasetsError, FileNotFoundError, ConnectionError, ValueError) as exc:
        hint = "" if is_offline() else " (without network, set HF_HUB_OFFLINE=1 to load from the local cache)"
        raise HubError(
            f"dataset id {dataset_id!r}: could not load split {split!r} from {source!r}{hint}: {exc}"
        ) from exc
