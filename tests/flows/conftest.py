import json
import shutil

import httpx
import pytest
from prefect.server.api.server import SubprocessASGIServer
from prefect.testing.utilities import prefect_test_harness

from tiny_models import save_tiny_model

TRAIN_ROWS = [
    [("Who are you?", "I am Twinkle, built by the Twinkle Flows team.")],
    [("What is your name?", "I am Twinkle.")],
    [("Who made you?", "The Twinkle Flows team made me.")],
    [("hello", "Hello! I am Twinkle."), ("who built you?", "The Twinkle Flows team.")],
]
HELDOUT_ROWS = [[("Could you tell me who you are?", "I am Twinkle, built by the Twinkle Flows team.")],
                [("Whose assistant are you?", "I am Twinkle.")]]


def write_chat_jsonl(path, conversations, repeat=1):
    lines = []
    for turns in conversations * repeat:
        messages = []
        for user, assistant in turns:
            messages += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
        lines.append(json.dumps({"messages": messages}))
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="session")
def prefect_harness():
    """One temporary Prefect API for the whole session (each one costs ~20 s to start)."""
    harness = start_prefect_harness()
    try:
        yield
    finally:
        harness.__exit__(None, None, None)


def start_prefect_harness(tries=3):
    """Prefect picks the server's port by binding port 0 and letting it go; until uvicorn binds it, a torchrun
    or gloo socket of the other xdist worker can take it, and the health check then reads a reset connection
    (httpx.ReadError, seen once in CI, failing every flow test). Start again on a new port."""
    for attempt in range(tries):
        harness = prefect_test_harness(server_startup_timeout=120)
        try:
            harness.__enter__()
            return harness
        except httpx.TransportError:
            _stop_failed_server()
            if attempt == tries - 1:
                raise


def _stop_failed_server():
    """The harness registers its server before starting it and leaves it there when the start fails."""
    server = SubprocessASGIServer._instances.pop(None, None)
    if server is not None:
        server.stop()


@pytest.fixture(scope="session")
def empty_mlflow_db(tmp_path_factory):
    """An MLflow sqlite store with its tables made (about 3 s of migrations), copied into each workspace."""
    from mlflow import MlflowClient

    path = tmp_path_factory.mktemp("mlflow") / "mlflow.db"
    client = MlflowClient(f"sqlite:///{path}")
    client.search_experiments()
    client.search_registered_models()
    return path


@pytest.fixture
def sft_workspace(tmp_path, monkeypatch, prefect_harness, empty_mlflow_db):
    """A tiny model, a tiny dataset, and isolated caches / MLflow store / run folders."""
    monkeypatch.setenv("TWINKLE_CACHE", str(tmp_path / "cache"))
    shutil.copy(empty_mlflow_db, tmp_path / "mlflow.db")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.chdir(tmp_path)
    return {
        "model": save_tiny_model(tmp_path / "tiny-llama", "llama"),
        "train": write_chat_jsonl(tmp_path / "train.jsonl", TRAIN_ROWS, repeat=4),
        "heldout": write_chat_jsonl(tmp_path / "heldout.jsonl", HELDOUT_ROWS),
        "root": tmp_path,
    }
