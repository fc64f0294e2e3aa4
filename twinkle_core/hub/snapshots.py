"""Fetch a repo snapshot from the Hugging Face Hub or ModelScope (the local cache only when offline)."""
from __future__ import annotations

import logging
import os
from pathlib import Path

from twinkle_core.hashing import hash_json

from .errors import HubError, HubUnreachable
from .ids import OFFLINE_ENV_VARS, ParsedId, is_offline

log = logging.getLogger(__name__)


def hf_cache_dir() -> Path:
    """The Hugging Face hub cache, read from the environment at call time (HF_HUB_CACHE, then HF_HOME)."""
    from huggingface_hub import constants

    # huggingface_hub reads these variables once at import; reading them here honours later changes.
    explicit = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    return Path(constants.HF_HUB_CACHE)


def ms_cache_dir() -> Path:
    """The ModelScope cache root as modelscope >= 1.38 lays it out (MODELSCOPE_CACHE, else ~/.cache/modelscope)."""
    return Path(os.environ.get("MODELSCOPE_CACHE") or Path.home() / ".cache" / "modelscope").expanduser()


def download_snapshot(parsed: ParsedId, text: str, repo_type: str) -> Path:
    """The local folder holding repo `parsed.name` at `parsed.revision` (repo_type 'model' or 'dataset')."""
    fetch = {"hf": _hf_snapshot, "ms": _ms_snapshot}[parsed.scheme]
    return fetch(parsed, text, repo_type)


def snapshot_hash(parsed: ParsedId, folder: Path) -> str:
    """A cheap content key for a hub snapshot: hub, repo, snapshot folder name and every file's size.

    A Hugging Face snapshot folder is named by its commit, which pins the content. A ModelScope folder is
    named by the revision asked for (often the branch 'master'), so file mtimes are added: a re-download
    then changes the key (a spurious cache miss, never a stale hit).
    """
    entries = []
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        stat = path.stat()
        entry = [path.relative_to(folder).as_posix(), stat.st_size]
        if parsed.scheme == "ms":
            entry.append(stat.st_mtime_ns)
        entries.append(entry)
    return hash_json({"hub": parsed.scheme, "repo": parsed.name, "snapshot": folder.name, "files": entries})


def _hf_snapshot(parsed: ParsedId, text: str, repo_type: str) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, HFValidationError, LocalEntryNotFoundError

    cache, offline = hf_cache_dir(), is_offline()
    log.info("resolving %s from the Hugging Face Hub%s", text, " cache (offline)" if offline else "")
    try:
        folder = snapshot_download(
            parsed.name, repo_type=repo_type, revision=parsed.revision, cache_dir=cache, local_files_only=offline
        )
    except LocalEntryNotFoundError as exc:
        flag = "--repo-type dataset " if repo_type == "dataset" else ""
        rev = f"--revision {parsed.revision} " if parsed.revision else ""
        raise (HubError if offline else HubUnreachable)(
            f"id {text!r} is not in the Hugging Face cache {cache} and could not be downloaded: "
            f"{_reason(offline)}. Populate the cache online with `hf download {flag}{rev}{parsed.name}`, "
            f"or point HF_HUB_CACHE / HF_HOME at a cache that has it. ({exc})"
        ) from exc
    except (HfHubHTTPError, HFValidationError) as exc:
        raise HubError(f"id {text!r}: the Hugging Face Hub refused {repo_type} {parsed.name!r}: {exc}") from exc
    return Path(folder)


def _ms_snapshot(parsed: ParsedId, text: str, repo_type: str) -> Path:
    cache, offline = ms_cache_dir(), is_offline()
    log.info("resolving %s from ModelScope%s", text, " cache (offline)" if offline else "")
    # modelscope's exception classes moved between releases (modelscope_hub since 1.38), so any failure
    # of its download call is caught and reported as a HubError with the original chained.
    try:
        return _ms_download(parsed, repo_type, cache, local_files_only=offline)
    except Exception as exc:  # noqa: BLE001 - see above
        error = exc
    if not offline:
        # Unlike huggingface_hub, modelscope does not fall back to its cache when the hub is unreachable.
        try:
            folder = _ms_download(parsed, repo_type, cache, local_files_only=True)
        except Exception:  # noqa: BLE001 - not cached either: report the online error below
            folder = None
        if folder is not None:
            log.warning("ModelScope failed for %s (%s); using the cached snapshot %s", text, error, folder)
            return folder
    rev = f" --revision {parsed.revision}" if parsed.revision else ""
    raise (HubError if offline else HubUnreachable)(
        f"id {text!r} could not be resolved from ModelScope: {_reason(offline)}; cache searched: "
        f"{cache}. Populate it online with `modelscope download --{repo_type} {parsed.name}{rev}` "
        f"or point MODELSCOPE_CACHE at a cache that has it. ({type(error).__name__}: {error})"
    ) from error


def _ms_download(parsed: ParsedId, repo_type: str, cache: Path, local_files_only: bool) -> Path:
    from modelscope.hub.snapshot_download import snapshot_download

    # modelscope reads MODELSCOPE_CACHE once per process (its default config), so pass it explicitly.
    folder = snapshot_download(
        repo_id=parsed.name, repo_type=repo_type, revision=parsed.revision, cache_dir=cache,
        local_files_only=local_files_only,
    )
    return Path(folder)


def _reason(offline: bool) -> str:
    if offline:
        return f"offline mode is on (one of {', '.join(OFFLINE_ENV_VARS)} is set): only the local cache is searched"
    return "the hub could not be reached or refused the request"
