import contextlib

import pytest

from registered_models import register_run, register_vl, train_adapter


@contextlib.contextmanager
def _registry(root):
    """`root`'s MLflow sqlite store and cache as the process's, while the block runs."""
    with pytest.MonkeyPatch.context() as env:
        uri = f"sqlite:///{root / 'mlflow.db'}"
        env.setenv("MLFLOW_TRACKING_URI", uri)
        env.setenv("TWINKLE_CACHE", str(root / "cache"))
        yield {"root": root, "uri": uri}


@pytest.fixture(scope="session")
def registered(tmp_path_factory):
    """A real MLflow sqlite store holding 'tiny-chat' (the adapter) and 'tiny-chat-merged', both champions."""
    with _registry(tmp_path_factory.mktemp("registered")) as registry:
        train_adapter(registry["root"] / "base", registry["root"] / "adapter")
        adapter = register_run(registry["root"], "tiny-chat", "adapter")
        merged = register_run(registry["root"], "tiny-chat-merged", "merged")
        yield {**registry, "adapter": adapter, "merged": merged}


@pytest.fixture(scope="session")
def vl_registry(tmp_path_factory):
    """A real MLflow store holding 'tiny-vl' (a Qwen 3.5 VL LoRA adapter) and 'tiny-vl-merged'."""
    with _registry(tmp_path_factory.mktemp("vl-registry")) as registry:
        yield {**registry, "reference": register_vl(registry["root"])}


@pytest.fixture
def store(registered, monkeypatch):
    """The registered store as the current process's tracking URI and cache."""
    return _use(registered, monkeypatch)


@pytest.fixture
def vl_store(vl_registry, monkeypatch):
    return _use(vl_registry, monkeypatch)


def _use(registry: dict, monkeypatch) -> dict:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", registry["uri"])
    monkeypatch.setenv("TWINKLE_CACHE", str(registry["root"] / "cache"))
    return registry
