"""The folders of resumable training states, kept with checksums so that a damaged one is never resumed.

    checkpoint_dir/training_state/step-00000012/   progress.json, the backend's files, manifest.json
    checkpoint_dir/training_state/step-00000015/   the newest; only the last `keep` are kept

A state is written under a hidden temporary name and renamed when complete; `manifest.json`, written last,
holds the sha256 of every other file. A crash or a full disk while saving therefore leaves the earlier
states as they were. On resume the newest state whose files match their checksums is used; a truncated or
corrupted one is skipped with a warning that names it and the one used instead.
Both backends use these folders (their files differ: one `state.pt`, or a Megatron dist checkpoint).
"""
from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

from twinkle_core.hashing import hash_file

logger = logging.getLogger(__name__)
STATE_DIR, PROGRESS_FILE, MANIFEST_FILE = "training_state", "progress.json", "manifest.json"


def state_root(checkpoint_dir: str | Path) -> Path:
    return Path(checkpoint_dir) / STATE_DIR


def state_name(step: int) -> str:
    return f"step-{step:08d}"


def partial_dir(checkpoint_dir: str | Path, step: int) -> Path:
    """Where a state is written before it is complete (hidden: never listed as a state)."""
    return state_root(checkpoint_dir) / f".{state_name(step)}.partial"


def remove_partial(checkpoint_dir: str | Path) -> None:
    """Writes that a crash or an error interrupted."""
    for stale in state_root(checkpoint_dir).glob(".step-*"):
        shutil.rmtree(stale, ignore_errors=True)


def finish_state(partial: Path, progress: dict, keep: int) -> Path:
    """Write progress and the manifest into a fully written `partial`, publish it, keep the newest `keep`."""
    (partial / PROGRESS_FILE).write_text(json.dumps(progress, indent=2))
    write_manifest(partial)
    final = partial.parent / partial.name[1:].removesuffix(".partial")
    if final.exists():  # the same step again (a resumed run re-saving): replace it
        shutil.rmtree(final)
    partial.rename(final)
    for old in saved_states(partial.parent.parent)[keep:]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def write_manifest(folder: Path) -> None:
    """The sha256 of every file in `folder`, written last (`damage` checks a folder against it)."""
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST_FILE)
    manifest = {str(p.relative_to(folder)): hash_file(p) for p in files}
    (folder / MANIFEST_FILE).write_text(json.dumps(manifest, indent=1))


def saved_states(checkpoint_dir: str | Path) -> list[Path]:
    """Published states, newest first (not yet checked against their manifests)."""
    root = state_root(checkpoint_dir)
    states = [p for p in root.glob("step-*") if (p / MANIFEST_FILE).is_file()] if root.is_dir() else []
    return sorted(states, key=lambda p: p.name, reverse=True)


def damage(state: Path) -> str | None:
    """What is wrong with a state's files against its manifest (None: every file is as it was written)."""
    manifest = json.loads((state / MANIFEST_FILE).read_text())
    for name, digest in manifest.items():
        path = state / name
        if not path.is_file():
            return f"{name} is missing"
        if hash_file(path) != digest:
            return f"{name} does not match its checksum (truncated or corrupted)"
    return None


def newest_intact_state(checkpoint_dir: str | Path) -> Path | None:
    """The newest state whose files match their checksums; each damaged newer one is skipped, saying so."""
    damaged = []
    for state in saved_states(checkpoint_dir):
        problem = damage(state)
        if problem is None:
            if damaged:
                logger.warning("resuming from %s instead: %s", state.name, "; ".join(damaged))
            return state
        damaged.append(f"{state} is damaged ({problem})")
        logger.warning("skipping the training state %s: %s", state, problem)
    if damaged:
        logger.warning("no intact training state is left (%s): starting over", "; ".join(damaged))
    return None


def read_progress(checkpoint_dir: str | Path) -> dict | None:
    """The progress record of the newest published state, or None when there is none."""
    states = saved_states(checkpoint_dir)
    return json.loads((states[0] / PROGRESS_FILE).read_text()) if states else None
