"""What every worker entry point (`python -m twinkle_core.<x> CONFIG.json`) does first."""
from __future__ import annotations

import logging
import sys
from pathlib import Path


def worker_config_path(argv: list[str] | None, usage: str) -> Path:
    """Set up worker logging and return the one CONFIG.json argument (exit 2 with `usage` otherwise)."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print(f"usage: {usage}", file=sys.stderr)
        raise SystemExit(2)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return Path(argv[0])
