"""A real local Prefect server and a `python -m deployments.serve` process, shared by the module's tests.

Not the ephemeral per-process API: the server runs as `prefect server start` on a free port with its own
database, the deployments are served from a subprocess exactly as the README says, and flow runs are
created through the API as the UI creates them. Everything is shut down at the end.
"""
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from prefect.settings import PREFECT_API_URL, temporary_settings

from tiny_models import SAMPLE_ROWS, save_tiny_model

ROOT = Path(__file__).resolve().parents[2]
PREFECT = [sys.executable, "-m", "prefect"]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"prefect server exited:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"prefect server not healthy after {timeout_s} s:\n{log.read_text()[-3000:]}")


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM the process group (server or serve and its flow-run subprocesses), SIGKILL if it lingers."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=20)
            return
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory):
    """`prefect server start` on a free port; yields its environment (PREFECT_API_URL, home, database)."""
    root = tmp_path_factory.mktemp("prefect-server")
    for attempt in range(3):  # the free port can be taken (by the other xdist worker's torchrun) before we bind it
        port = _free_port()
        env = {**os.environ, "PREFECT_HOME": str(root / "home"), "PREFECT_API_URL": f"http://127.0.0.1:{port}/api",
               "PREFECT_SERVER_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{root / 'prefect.db'}",
               "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_UI_ENABLED": "false"}
        env.pop("PREFECT_API_KEY", None)
        log = root / "server.log"
        server = subprocess.Popen([*PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                                  env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
        try:
            _wait_healthy(env["PREFECT_API_URL"], server, log)
            break
        except RuntimeError:
            _stop(server)
            if attempt == 2:
                raise
    try:
        yield {"env": env, "url": env["PREFECT_API_URL"], "root": root}
    finally:
        _stop(server)


@pytest.fixture(scope="module")
def served(prefect_server, tmp_path_factory):
    """The deployments served by `python -m deployments.serve`, a tiny model and data, a "gpu" limit of 1."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate

    root = tmp_path_factory.mktemp("served")
    data = root / "train.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in SAMPLE_ROWS * 4))
    env = {**prefect_server["env"], "MLFLOW_TRACKING_URI": f"sqlite:///{root / 'mlflow.db'}",
           "TWINKLE_CACHE": str(root / "cache"), "PREFECT_RUNNER_POLL_FREQUENCY": "1",
           "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    with temporary_settings({PREFECT_API_URL: prefect_server["url"]}):
        with get_client(sync_client=True) as client:
            client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name="gpu", limit=1))
        log = root / "serve.log"
        serve = subprocess.Popen([sys.executable, "-m", "deployments.serve"], cwd=ROOT, env=env,
                                 stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
        try:
            from deployments.presets import build_deployments

            last = build_deployments()[-1]  # serve creates them in order: wait until all exist
            _wait_for_deployment(f"{last.flow_name}/{last.name}", serve, log)
            yield {"model": save_tiny_model(root / "tiny-llama"), "train": data, "root": root, "env": env,
                   "log": log}
        finally:
            _stop(serve)


def _wait_for_deployment(name: str, proc: subprocess.Popen, log: Path, timeout_s: float = 120) -> None:
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    deadline = time.monotonic() + timeout_s
    with get_client(sync_client=True) as client:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"deployments.serve exited:\n{log.read_text()[-3000:]}")
            try:
                client.read_deployment_by_name(name)
                return
            except ObjectNotFound:
                time.sleep(1)
    raise RuntimeError(f"{name} was not served within {timeout_s} s:\n{log.read_text()[-3000:]}")
