"""The folder of one flow run (configs, checkpoints, eval results); a retry of the flow run reuses it, and
so does `python -m flows.<name> --resume RUN_FOLDER`.

Reusing it is what lets a retried run resume training from the training state its first attempt saved.
The folder also keeps the run's parameters (`parameters.json`), which `--resume` starts from.
"""
from __future__ import annotations

import contextlib
import contextvars
import json
import shutil
import time
from pathlib import Path
from typing import Iterator

from prefect.runtime import flow_run

from twinkle_core.errors import user_error
from twinkle_core.models.state_dirs import STATE_DIR

FLOW_RUN_ID_FILE = "prefect_flow_run_id"
PARAMETERS_FILE = "parameters.json"
_RESUME: contextvars.ContextVar[Path | None] = contextvars.ContextVar("resume_folder", default=None)
_CREATED: dict[str, Path] = {}  # flow run id: the folder run_folder made for it (not a resumed one)


@contextlib.contextmanager
def resuming(folder: Path | None) -> Iterator[None]:
    """Inside, the flow run works in `folder` (an earlier run's), so training resumes from its last state."""
    token = _RESUME.set(folder)
    try:
        yield
    finally:
        _RESUME.reset(token)


def run_folder(output_dir: str, config=None) -> Path:
    """`output_dir/<time>-<flow run name>`: the first attempt's folder when this flow run ran before, or the
    folder given to --resume. A new folder records `config` (the flow's parameters) for a later --resume."""
    if _RESUME.get() is not None:
        return _RESUME.get()
    root = Path(output_dir).resolve()
    run_id = str(flow_run.id) if flow_run.id else None
    for earlier in sorted(root.glob(f"*-{flow_run.name}")) if run_id else []:
        marker = earlier / FLOW_RUN_ID_FILE
        if marker.is_file() and marker.read_text() == run_id:
            return earlier
    folder = root / f"{time.strftime('%Y%m%d-%H%M%S')}-{flow_run.name or 'local'}"
    folder.mkdir(parents=True, exist_ok=True)
    if run_id:
        (folder / FLOW_RUN_ID_FILE).write_text(run_id)
        _CREATED[run_id] = folder
    if config is not None:
        (folder / PARAMETERS_FILE).write_text(json.dumps({"flow": config.kind,
                                                          "parameters": config.model_dump(mode="json")}, indent=2))
    return folder


def discard_bare_run_folder(flow, flow_run, state) -> None:
    """A flow's on_failure hook: a run that failed before writing anything (a bad id, data set or option)
    leaves no folder behind, nor does one a user's error stopped before its first training state (a reward
    that raised in the workers: only the worker configs were written). A folder with a training state, or
    with what a crash left (logs), is kept for --resume."""
    folder = _CREATED.pop(str(flow_run.id), None)
    if folder is None or not folder.is_dir():
        return
    if _users_error(state) and not any((folder / STATE_DIR).glob("step-*")):
        bare = [p for p in folder.rglob("*") if p.is_file() and not p.name.endswith("_config.json")
                and p.name not in (PARAMETERS_FILE, FLOW_RUN_ID_FILE)]
    else:
        bare = [p for p in folder.rglob("*") if p.is_file() and p.name not in (PARAMETERS_FILE, FLOW_RUN_ID_FILE)]
    if bare:
        return
    shutil.rmtree(folder, ignore_errors=True)
    with contextlib.suppress(OSError):
        folder.parent.rmdir()  # output_dir too, when this run was all it held


def _users_error(state) -> bool:
    try:
        error = state.result(raise_on_failure=False)
    except Exception:  # noqa: BLE001 - a result that cannot be read is not a user's error
        return False
    return isinstance(error, BaseException) and user_error(error) is not None


def resume_parameters(folder: Path, kind: str) -> dict:
    """The parameters an earlier run of this flow in `folder` started with (what --resume starts from)."""
    path = folder / PARAMETERS_FILE
    if not folder.is_dir():
        raise SystemExit(f"--resume {folder}: no such run folder")
    if not path.is_file():
        raise SystemExit(f"--resume {folder}: no {PARAMETERS_FILE} in it; give the folder of a run this project "
                         "started (output_dir/<time>-<run name>)")
    saved = json.loads(path.read_text())
    if saved["flow"] != kind:
        raise SystemExit(f"--resume {folder}: that folder is a run of the {saved['flow']} flow, not of {kind}")
    return saved["parameters"]
