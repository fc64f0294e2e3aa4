"""`mlflow models serve -m models:/NAME@champion --env-manager local`: a real server answers a chat over HTTP."""
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from registered_models import ANSWER, QUESTION


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_until_up(url: str, server: subprocess.Popen, log: Path, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise AssertionError(f"the server exited with {server.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(0.5)
    raise AssertionError(f"no answer from {url} within {timeout_s} s:\n{log.read_text()[-3000:]}")


def test_served_champion_answers_a_chat_request(registered, tmp_path):
    port = _free_port()
    # uvicorn is started by name: the interpreter's bin folder goes first on PATH
    env = {**os.environ, "MLFLOW_TRACKING_URI": registered["uri"], "TWINKLE_CACHE": str(registered["root"] / "cache"),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    log = tmp_path / "serve.log"
    with log.open("w") as out:
        server = subprocess.Popen(
            [sys.executable, "-m", "mlflow", "models", "serve", "-m", "models:/tiny-chat@champion", "--env-manager",
             "local", "-h", "127.0.0.1", "-p", str(port), "-w", "1"],
            env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait_until_up(f"http://127.0.0.1:{port}/ping", server, log)
        body = {"dataframe_records": [{"messages": QUESTION}], "params": {"max_new_tokens": 12}}
        request = urllib.request.Request(f"http://127.0.0.1:{port}/invocations", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            assert json.loads(response.read()) == {"predictions": [ANSWER]}
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
    assert server.returncode is not None
