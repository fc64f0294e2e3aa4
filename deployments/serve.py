"""Serve every flow's deployments (deployments/presets.py) from this process: UI-triggered runs and schedules.

    prefect server start                      # in one terminal (UI on http://127.0.0.1:4200)
    python -m deployments.serve               # in another: serves sft/default, sft/nightly, ... until stopped

Then run a deployment from the UI ("Run" → "Custom run" to edit the parameter form), or
`prefect deployment run sft/default --param config='{"epochs": 1}'`. Each run executes in a subprocess of
this one; cancelling it in the UI stops its training workers. For a work pool instead of a long-lived
process, see deployments/prefect.yaml (`prefect deploy --all`).
"""
from __future__ import annotations

import logging

from prefect import serve

from deployments.presets import build_deployments

if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    serve(*build_deployments())
