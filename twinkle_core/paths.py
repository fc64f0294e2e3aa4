"""Where the project keeps its caches (materialised models, tokenised data, conversions)."""
from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """The cache root: $TWINKLE_CACHE, else ~/.cache/twinkle_flows."""
    root = os.environ.get("TWINKLE_CACHE") or Path.home() / ".cache" / "twinkle_flows"
    path = Path(root).expanduser()
    path.mkdir(parents=True, exist_ok=True)
    return path


def cache_dir(kind: str) -> Path:
    """A sub-folder of the cache root for one kind of artefact (e.g. 'models', 'tokenized')."""
    path = cache_root() / kind
    path.mkdir(parents=True, exist_ok=True)
    return path
