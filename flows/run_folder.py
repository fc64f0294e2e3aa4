"""The folder of one flow run (configs, checkpoints, eval results); a retry of the flow run reuses it.

Reusing it is what lets a retried run resume training from the training state its first attempt saved.
"""
from __future__ import annotations

import time
from pathlib import Path

from prefect.runtime import flow_run

FLOW_RUN_ID_FILE = "prefect_flow_run_id"


def run_folder(output_dir: str) -> Path:
    """`output_dir/<time>-<flow run name>`: the first attempt's folder when this flow run ran before."""
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
    return folder
