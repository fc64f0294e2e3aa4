"""Each training session is an MLflow run, its models' losses and steps logged as they train.

MLflow's client calls block (a database write each), so they run on one thread of their own, fed by a
queue: a slow tracking store delays the metrics, never a training request. The run names the session, its
SDK version and the base model; the API key never reaches MLflow (only a short hash of it, to group a user's
sessions). Metrics are per training model: `<model>.loss_sum`, `<model>.tokens` at each forward_backward
and `<model>.grad_norm`, `<model>.learning_rate` at each optim_step, at the model's step number.
"""
from __future__ import annotations

import hashlib
import logging
import queue
import threading
import time

from twinkle_core.tracking.logger import experiment_id

logger = logging.getLogger(__name__)
EXPERIMENT = "twinkle-service"


def key_hash(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()[:16]


class SessionRuns:
    def __init__(self, tracking_uri: str, base_model: str):
        self.uri, self.base_model = tracking_uri, base_model
        self._queue: queue.Queue = queue.Queue()
        self._runs: dict[str, str] = {}  # session id: MLflow run id
        self._thread = threading.Thread(target=self._work, name="twinkle-mlflow", daemon=True)
        self._thread.start()

    # ----- called on the event loop: never blocks ----------------------------------------------------
    def start(self, session_id: str, key: str, sdk_version: str, user_metadata: dict | None) -> None:
        self._queue.put(("start", session_id, (key_hash(key), sdk_version, dict(user_metadata or {}))))

    def log(self, session_id: str, metrics: dict[str, float], step: int) -> None:
        self._queue.put(("log", session_id, (dict(metrics), step, int(time.time() * 1000))))

    def end(self, session_id: str, status: str) -> None:
        self._queue.put(("end", session_id, status))

    def register(self, session_id: str, name: str, checkpoint: str, base, loss: float | None) -> None:
        """Register the adapter folder `checkpoint` as a version of `name`: the flows' chat model (adapter on
        `base`), logged by a run of its own under the session's run; the lowest training loss is champion."""
        self._queue.put(("register", session_id, (name, checkpoint, base, loss)))

    def flush(self, timeout: float = 30.0) -> None:
        """Wait until everything queued so far is written (tests; shutdown)."""
        done = threading.Event()
        self._queue.put(("flush", None, done))
        done.wait(timeout)

    def run_id(self, session_id: str) -> str | None:
        return self._runs.get(session_id)

    # ----- the MLflow thread -------------------------------------------------------------------------
    def _work(self) -> None:
        from mlflow import MlflowClient

        client = MlflowClient(tracking_uri=self.uri)
        while True:
            kind, session_id, payload = self._queue.get()
            try:
                if kind == "flush":
                    payload.set()
                elif kind == "start":
                    owner, sdk_version, metadata = payload
                    tags = {"twinkle.service.session": session_id, "twinkle.service.key_hash": owner,
                            "twinkle.base_model_id": self.base_model, "tinker.sdk_version": sdk_version,
                            **{f"user.{k}": str(v)[:500] for k, v in metadata.items()}}
                    self._runs[session_id] = client.create_run(experiment_id(client, EXPERIMENT), tags=tags,
                                                               run_name=f"session-{session_id}").info.run_id
                elif kind == "log" and session_id in self._runs:
                    from mlflow.entities import Metric

                    metrics, step, now = payload
                    client.log_batch(self._runs[session_id],
                                     metrics=[Metric(k, float(v), now, step) for k, v in metrics.items()])
                elif kind == "end" and session_id in self._runs:
                    client.set_terminated(self._runs[session_id], status=payload)
                elif kind == "register":
                    self._register(client, session_id, *payload)
            except Exception as exc:  # tracking is a record, not a reason to fail training
                logger.warning("MLflow %s for session %s failed: %s", kind, session_id, exc)

    def _register(self, client, session_id: str, name: str, checkpoint: str, base, loss: float | None) -> None:
        from twinkle_core.tracking.model_logging import log_chat_model
        from twinkle_core.tracking.registry import register_version

        tags = {"twinkle.service.session": session_id, "twinkle.service.checkpoint": checkpoint}
        if session_id in self._runs:
            tags["mlflow.parentRunId"] = self._runs[session_id]
        run = client.create_run(experiment_id(client, EXPERIMENT), tags=tags, run_name=f"register-{name}")
        run_id = run.info.run_id
        base_tags = log_chat_model(client, run_id, checkpoint, base, "adapter", "model")
        score = float("inf") if loss is None else loss
        if loss is not None:
            client.log_metric(run_id, "train_loss", loss)
        result = register_version(client, name, run_id, "model", score, metric="train_loss")
        for key, value in base_tags.items():
            client.set_model_version_tag(name, result.version, key, value)
        client.set_terminated(run_id)
        logger.info("registered %s as %s version %s (%s)", checkpoint, name, result.version, result.decision())
