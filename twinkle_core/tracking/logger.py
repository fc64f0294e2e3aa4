"""Metrics and params to an MLflow run, from the flow process or a training worker."""
from __future__ import annotations

import os
import time
from typing import Any, Mapping

_SECRET_WORDS = ("token", "password", "secret", "api_key", "apikey", "key", "credential")
REDACTED = "***"


def tracking_uri() -> str:
    """MLFLOW_TRACKING_URI, else a SQLite store in the working directory (the registry needs a database)."""
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{os.path.abspath('mlflow.db')}"


def experiment_id(client, name: str) -> str:
    """The id of MLflow experiment `name`, created if it does not exist yet."""
    experiment = client.get_experiment_by_name(name)
    return experiment.experiment_id if experiment else client.create_experiment(name)


def redact(params: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """Flatten nested params to 'a.b' keys, replacing values of secret-looking keys with ***."""
    flat: dict[str, str] = {}
    for key, value in params.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(redact(value, prefix=f"{name}."))
        elif any(word in key.lower() for word in _SECRET_WORDS) and value not in (None, ""):
            flat[name] = REDACTED
        else:
            flat[name] = str(value)[:6000]
    return flat


class MetricsLogger:
    """Buffers step metrics and writes them to one MLflow run in batches (cheap for per-step logging)."""

    def __init__(self, uri: str | None, run_id: str | None, flush_every: int = 10):
        self.run_id = run_id
        self.flush_every = flush_every
        self._buffer: list = []
        self._client = None
        if run_id:
            from mlflow import MlflowClient

            self._client = MlflowClient(tracking_uri=uri or tracking_uri())

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        if self._client is None:
            return
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self._buffer += [Metric(k, float(v), now, step) for k, v in metrics.items()]
        if len(self._buffer) >= self.flush_every * max(1, len(metrics)):
            self.flush()

    def flush(self) -> None:
        if self._client is not None and self._buffer:
            self._client.log_batch(self.run_id, metrics=self._buffer)
            self._buffer = []
