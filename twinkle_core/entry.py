"""What every worker entry point (`python -m twinkle_core.<x> CONFIG.json`) does first."""
from __future__ import annotations

import json
import logging
import multiprocessing
import os
import sys
from pathlib import Path
from typing import NoReturn


USER_ERROR_MARK = "TWINKLE_USER_ERROR "  # twinkle_core.launch turns this line back into the user's error


def report_user_errors_in_one_line() -> None:
    """An uncaught UserError in this worker (a reward that raises, a bad image, a row the data cannot give)
    ends it with one marked line, not a traceback: the launcher raises it again in the orchestrator, which
    prints it once. TWINKLE_DEBUG=1 (the flows' --debug) keeps Python's traceback."""
    previous = sys.excepthook

    def hook(kind, error, trace):
        from twinkle_core.errors import UserError

        if isinstance(error, UserError) and not os.environ.get("TWINKLE_DEBUG"):
            print(USER_ERROR_MARK + json.dumps({"kind": kind.__name__, "message": str(error)}), file=sys.stderr,
                  flush=True)
            return
        previous(kind, error, trace)

    sys.excepthook = hook


def worker_config_path(argv: list[str] | None, usage: str) -> Path:
    """Set up worker logging and return the one CONFIG.json argument (exit 2 with `usage` otherwise)."""
    report_user_errors_in_one_line()
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
