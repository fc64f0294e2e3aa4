"""The tags a registered model version carries: where it came from and how it scored.

Each version names the Prefect flow run that trained it, its base model (id, revision, content hash), its
training data (id, content hash), its held-out metrics and the git commit of this project.
"""
from __future__ import annotations

import subprocess
from pathlib import Path

from mlflow import MlflowClient

RUN_TAGS = ("flow", "prefect_flow_run", "prefect_flow_run_name", "prefect_flow_run_url", "prefect_deployment")


def project_commit() -> str:
    """The git commit this project's code is at ('' outside a git checkout, e.g. an installed wheel)."""
    root = Path(__file__).resolve().parents[2]
    try:
        done = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return done.stdout.strip() if done.returncode == 0 else ""


def held_out_metrics(client: MlflowClient, run_id: str) -> dict[str, float]:
    """The trained model's evaluation metrics of the run (eval_*, and the exported model's validation_*)."""
    metrics = client.get_run(run_id).data.metrics
    return {k: v for k, v in metrics.items() if k.startswith("eval_") or "validation" in k}


def version_tags(client: MlflowClient, run_id: str, base_tags: dict[str, str], dataset_id: str | None = None,
                 dataset_hash: str | None = None, extra: dict[str, str] | None = None) -> dict[str, str]:
    """Every lineage tag of the version made from `run_id` (the run's Prefect tags, then `extra`)."""
    run_tags = client.get_run(run_id).data.tags
    tags = {key: run_tags[key] for key in RUN_TAGS if key in run_tags}
    tags.update(extra or {})
    tags.update(base_tags)
    if dataset_id:
        tags["twinkle.dataset_id"] = dataset_id
    if dataset_hash:
        tags["twinkle.dataset_content_hash"] = dataset_hash
    tags.update({f"metric.{name}": f"{value:.6g}" for name, value in held_out_metrics(client, run_id).items()})
    commit = project_commit()
    if commit:
        tags["twinkle.git_commit"] = commit
    return tags
