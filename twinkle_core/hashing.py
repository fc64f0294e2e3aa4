"""Content hashes: the cache keys that tasks pass across the Prefect boundary."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

_CHUNK = 1 << 20


def hash_file(path: str | Path) -> str:
    """sha256 of a file's bytes (hex)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(_CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


def hash_tree(root: str | Path) -> str:
    """sha256 over every file under `root`: relative path and content, in sorted order."""
    root = Path(root)
    if root.is_file():
        return hash_file(root)
    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        digest.update(path.relative_to(root).as_posix().encode())
        digest.update(hash_file(path).encode())
    return digest.hexdigest()


def hash_json(obj: object) -> str:
    """sha256 of a JSON-serialisable object, independent of key order."""
    text = json.dumps(obj, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()
