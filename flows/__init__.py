"""Twinkle Flows' Prefect flows (`python -m flows.sft`, ...).

Runs are offline by default: the Prefect server this project starts (the temporary one of a local run, or
`prefect server start` from the same environment) sends no anonymous analytics. Set
PREFECT_SERVER_ANALYTICS_ENABLED=true to send them.
"""
import os

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")  # before prefect reads its settings
