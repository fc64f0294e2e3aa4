"""Links into the MLflow UI (run pages, artifacts) and the loss-curve plot that the run reports embed.

The MLflow UI's address is `MLFLOW_UI_URL` (default http://127.0.0.1:5000, what `mlflow ui` serves); the
tracking store itself may be a local SQLite file, so the links are built, not asked of the store.
"""
from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import quote

LOSS_CURVE = "plots/loss_curve.png"


def mlflow_ui_url() -> str:
    return os.environ.get("MLFLOW_UI_URL", "http://127.0.0.1:5000").rstrip("/")


def run_url(experiment_id: str, run_id: str) -> str:
    return f"{mlflow_ui_url()}/#/experiments/{experiment_id}/runs/{run_id}"


def artifact_url(run_id: str, path: str) -> str:
    """The artifact file itself (the MLflow server's get-artifact route): an image renders inline."""
    return f"{mlflow_ui_url()}/get-artifact?path={quote(path, safe='')}&run_uuid={run_id}"


def plot_loss_curve(steps: list[int], losses: list[float], path: str | Path, title: str = "training loss") -> Path:
    """A small PNG of loss against optimizer step (matplotlib, no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.2), dpi=100)
    ax.plot(steps, losses, marker="." if len(steps) < 60 else None, linewidth=1.5)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return Path(path)
