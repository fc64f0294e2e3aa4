"""What every worker entry point (`python -m twinkle_core.<x> CONFIG.json`) does first."""
from __future__ import annotations

import logging
import multiprocessing
import os
import sys
from pathlib import Path
from typing import NoReturn


def worker_config_path(argv: list[str] | None, usage: str) -> Path:
    """Set up worker logging and return the one CONFIG.json argument (exit 2 with `usage` otherwise)."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print(f"usage: {usage}", file=sys.stderr)
        raise SystemExit(2)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return Path(argv[0])


def finish_worker(code: int | None = 0) -> NoReturn:
    """End a worker whose main returned: flush the streams and log handlers, then leave without Python's
    teardown. Unloading torch, transformers, peft and mlflow module by module takes 1–1.5 s a process
    (measured on 2 CPU cores), and a finished worker has closed its files and left its process group.
    A worker that raises does not come here: Python prints the traceback and exits as usual, and so does one
    with multiprocessing children (dist_checkpointing's savers), which only Python's exit ends: left
    running, they would hold the worker's stdout open and its reader would wait for ever."""
    if multiprocessing.active_children():
        sys.exit(code)
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code or 0)
