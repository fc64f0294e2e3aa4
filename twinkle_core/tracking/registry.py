"""Register a trained model version and decide whether it becomes the champion."""
from __future__ import annotations

import logging
from dataclasses import dataclass

from mlflow import MlflowClient
from mlflow.exceptions import MlflowException

logger = logging.getLogger(__name__)
CANDIDATE, CHAMPION = "candidate", "champion"


@dataclass(frozen=True)
class RegistrationResult:
    name: str
    version: str
    eval_loss: float
    champion_version: str | None  # the champion before this registration
    champion_loss: float | None
    promoted: bool
    label: str = "eval loss"  # what eval_loss / champion_loss measure (e.g. "recall@1" for embeddings)

    def decision(self) -> str:
        label = self.label
        if str(self.champion_version) == self.version:
            return (f"version {self.version} ({label} {self.eval_loss:.4f}) was registered by an earlier attempt of "
                    "this run and is champion")
        if self.champion_version is None:
            return f"no champion yet: version {self.version} ({label} {self.eval_loss:.4f}) becomes champion"
        if self.champion_loss is None:
            return (f"champion version {self.champion_version} has no recorded {label}: version {self.version} "
                    f"({label} {self.eval_loss:.4f}) becomes champion")
        verdict = "beats" if self.promoted else "does not beat"
        tail = "it becomes champion" if self.promoted else f"version {self.champion_version} stays champion"
        return (f"version {self.version} ({label} {self.eval_loss:.4f}) {verdict} champion version "
                f"{self.champion_version} ({label} {self.champion_loss:.4f}): {tail}")


def _champion(client: MlflowClient, name: str, metric: str) -> tuple[str | None, float | None]:
    try:
        version = client.get_model_version_by_alias(name, CHAMPION)
    except MlflowException:
        return None, None
    loss = client.get_run(version.run_id).data.metrics.get(metric)
    return version.version, loss


def version_of_run(client: MlflowClient, name: str, run_id: str) -> str | None:
    """The version of `name` already made from this run (a register retry after a crash), if any."""
    try:
        found = client.search_model_versions(f"name = '{name}' and run_id = '{run_id}'")
    except MlflowException:  # no such registered model yet
        return None
    return str(min(int(v.version) for v in found)) if found else None


def register_version(
    client: MlflowClient, name: str, run_id: str, artifact_path: str, eval_loss: float, metric: str = "eval_loss",
    higher_is_better: bool = False,
) -> RegistrationResult:
    """Create a version of `name` from the run's artifact; alias it candidate; promote it if it wins.

    A run that already has a version of `name` (a retry) reuses it, so a run never makes two versions.

    `eval_loss` is the run's value of `metric` (lower wins, unless `higher_is_better`, e.g. recall@1)."""
    try:
        client.get_registered_model(name)
    except MlflowException:
        client.create_registered_model(name, description="Trained by Twinkle Flows.")
    champion_version, champion_loss = _champion(client, name, metric)
    version = version_of_run(client, name, run_id)
    if version is None:
        source = f"{client.get_run(run_id).info.artifact_uri}/{artifact_path}"
        version = client.create_model_version(name, source=source, run_id=run_id).version
    client.set_registered_model_alias(name, CANDIDATE, version)
    promoted = str(champion_version) == str(version) or champion_loss is None or (
        eval_loss > champion_loss if higher_is_better else eval_loss < champion_loss)
    if promoted:
        client.set_registered_model_alias(name, CHAMPION, version)
    label = "eval loss" if metric == "eval_loss" else metric.removeprefix("eval_").replace("_at_", "@")
    result = RegistrationResult(name, str(version), eval_loss, champion_version, champion_loss, promoted, label)
    logger.info("registered %s: %s", name, result.decision())
    return result
