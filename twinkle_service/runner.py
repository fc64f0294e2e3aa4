"""Runs the engine's work in arrival order per training model, batching forward_backward across tenants.

The HTTP side submits `Job`s and goes on (Tinker calls return a future at once). One thread owns the
engine. Each turn it takes what is waiting: if the oldest job is a forward_backward, every waiting
forward_backward whose model has nothing older still waiting joins it in one mixed-tenant pass; any other
job runs alone. So a model's own requests keep their order (its optim_step never overtakes its
forward_backward), and tenants who train at the same time share passes.
"""
from __future__ import annotations

import contextlib
import logging
import threading
import traceback
from dataclasses import dataclass
from typing import Any, Callable

from twinkle_core.errors import UserError

logger = logging.getLogger(__name__)

FORWARD_BACKWARD = "forward_backward"


@dataclass
class Job:
    kind: str  # forward_backward, create, remove, optim_step
    model_id: str
    args: Any
    done: Callable[[object, str | None, str], None]  # (result, error message, error category)


class EngineRunner:
    def __init__(self, build_engine: Callable[[], Any], max_batch_rows: int = 64):
        self._build = build_engine
        self.max_batch_rows = max_batch_rows
        self._jobs: list[Job] = []
        self._wake = threading.Condition()
        self._stopped = False
        self._held = False
        self.engine = None
        self.ready = threading.Event()
        self.failed: str | None = None
        self.passes = 0  # forward_backward passes run (one per batch): what batching saved shows here
        self._thread = threading.Thread(target=self._run, name="twinkle-engine", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        with self._wake:
            self._jobs.append(job)
            self._wake.notify()

    @contextlib.contextmanager
    def held(self):
        """Inside, jobs wait instead of running (a drain point for operators; tests use it to build a batch)."""
        with self._wake:
            self._held = True
        try:
            yield
        finally:
            with self._wake:
                self._held = False
                self._wake.notify()

    def waiting(self) -> int:
        with self._wake:
            return len(self._jobs)

    def stop(self) -> None:
        with self._wake:
            self._stopped = True
            self._wake.notify()
        self._thread.join(timeout=30)
        if hasattr(self.engine, "close"):
            self.engine.close()

    def _take(self) -> list[Job] | None:
        with self._wake:
            while (self._held or not self._jobs) and not self._stopped:
                self._wake.wait()
            if self._stopped:
                return None
            first = self._jobs[0]
            if first.kind != FORWARD_BACKWARD:
                return [self._jobs.pop(0)]
            batch, kept, blocked, rows = [], [], set(), 0
            for job in self._jobs:
                size = len(job.args.data) if job.kind == FORWARD_BACKWARD else 0
                if job.kind == FORWARD_BACKWARD and job.model_id not in blocked and (not batch or rows + size <= self.max_batch_rows):
                    batch.append(job)
                    rows += size
                else:
                    blocked.add(job.model_id)
                    kept.append(job)
            self._jobs = kept
            return batch

    def _run(self) -> None:
        try:
            self.engine = self._build()
        except Exception as exc:  # the server reports it on every request instead of hanging
            self.failed = f"the model failed to load: {exc}"
            logger.error("%s", self.failed)
        self.ready.set()
        while True:
            jobs = self._take()
            if jobs is None:
                return
            if self.failed:
                for job in jobs:
                    job.done(None, self.failed, "server")
                continue
            try:
                self._execute(jobs)
            except Exception as exc:  # a bug here must fail these requests, not the server
                logger.error("engine error: %s", traceback.format_exc())
                for job in jobs:
                    job.done(None, f"internal error: {type(exc).__name__}: {exc}", "server")

    def _execute(self, jobs: list[Job]) -> None:
        engine = self.engine
        if jobs[0].kind == FORWARD_BACKWARD:
            self.passes += 1
            for job, outcome in zip(jobs, engine.forward_backward([job.args for job in jobs])):
                job.done(outcome.result, outcome.error, "user")
            return
        job = jobs[0]
        try:
            result = getattr(engine, job.kind)(**job.args)
        except UserError as exc:
            job.done(None, str(exc), "user")
            return
        job.done(result, None, "")
