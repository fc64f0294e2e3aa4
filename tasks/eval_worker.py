"""What every evaluation task does around its worker process: write the worker's config into the run
folder, run `python -m <module> [verb] CONFIG.json` in its own process (streamed to the Prefect log), read
back the JSON it wrote to `config.result_path`, and log each model's numbers to the MLflow run."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Callable

from mlflow import MlflowClient
from prefect import get_run_logger

from twinkle_core.launch import run_streaming
from twinkle_core.tracking import tracking_uri


def run_eval_worker(module: str, config, config_path: Path, timeout_s: float | None, verb: str | None = None):
    """Run the worker on `config` (saved at `config_path`); its result (JSON)."""
    config_path.write_text(config.model_dump_json(indent=2))
    run_streaming([sys.executable, "-m", module, *([verb] if verb else []), str(config_path)],
                  get_run_logger().info, timeout_s=timeout_s)
    return json.loads(config.result_path.read_text())


def log_eval_reports(mlflow_run_id: str | None, reports: dict[str, dict],
                     metrics: Callable[[dict], dict[str, float]]) -> None:
    """`metrics(report)` of each model as MLflow metrics (eval_<name> for the trained model, <label>_eval_<name>
    for the others), and the whole report as eval/report.json."""
    if not mlflow_run_id:
        return
    client = MlflowClient(tracking_uri())
    for label, report in reports.items():
        prefix = "eval" if label == "trained" else f"{label}_eval"
        for name, value in metrics(report).items():
            client.log_metric(mlflow_run_id, f"{prefix}_{name}", value)
    client.log_dict(mlflow_run_id, reports, "eval/report.json")
