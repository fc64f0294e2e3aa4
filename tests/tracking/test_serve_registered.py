"""`mlflow models serve -m models:/NAME@champion --env-manager local`: a real server answers a chat over HTTP,
and a vision-language model's server answers about a base64 image."""
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from registered_models import ANSWER, QUESTION, data_url, image_question, trained_answer
from vision_models import write_image


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


@contextlib.contextmanager
def _served(model_uri: str, uri: str, cache: Path, log: Path):
    """`mlflow models serve` of `model_uri` in its own process group; yields the /invocations URL."""
    port = _free_port()
    # uvicorn is started by name: the interpreter's bin folder goes first on PATH
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri, "TWINKLE_CACHE": str(cache),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    with log.open("w") as out:
        server = subprocess.Popen(
            [sys.executable, "-m", "mlflow", "models", "serve", "-m", model_uri, "--env-manager",
             "local", "-h", "127.0.0.1", "-p", str(port), "-w", "1"],
            env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait_until_up(f"http://127.0.0.1:{port}/ping", server, log)
        yield f"http://127.0.0.1:{port}/invocations"
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
    assert server.returncode is not None


def _ask(url: str, body: dict):
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


def test_served_champion_answers_a_chat_request(registered, tmp_path):
    with _served("models:/tiny-chat@champion", registered["uri"], registered["root"] / "cache",
                 tmp_path / "serve.log") as url:
        body = {"dataframe_records": [{"messages": QUESTION}], "params": {"max_new_tokens": 12}}
        assert _ask(url, body) == {"predictions": [ANSWER]}


def test_served_vision_language_model_answers_about_a_base64_image(vl_registry, tmp_path):
    picture = write_image(tmp_path / "stripes.png", seed=3, size=(64, 64))
    with _served("models:/tiny-vl@champion", vl_registry["uri"], vl_registry["root"] / "cache",
                 tmp_path / "serve.log") as url:
        body = {"dataframe_records": [{"messages": image_question(data_url(picture))}],
                "params": {"max_new_tokens": 6}}
        assert _ask(url, body) == {"predictions": [trained_answer(vl_registry["root"], picture)]}
