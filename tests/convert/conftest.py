"""The bridge runs of tests/convert, started once per session (see bridge_runs.py)."""
from __future__ import annotations

import pytest

from bridge_runs import LAYOUTS, BridgeRuns, build_models, run_layout, write_job


@pytest.fixture(scope="session")
def bridge_runs(tmp_path_factory) -> BridgeRuns:
    root = tmp_path_factory.mktemp("bridge")
    models = build_models(root)
    job = write_job(root, models)
    for layout in LAYOUTS:  # tp2 first: the others load its dist checkpoints
        run_layout(job, layout)
    return BridgeRuns(root, models)
