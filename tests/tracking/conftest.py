import pytest

from registered_models import register_run, register_vl, train_adapter


@pytest.fixture(scope="session")
def registered(tmp_path_factory):
    """A real MLflow sqlite store holding 'tiny-chat' (the adapter) and 'tiny-chat-merged', both champions."""
    root = tmp_path_factory.mktemp("registered")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{root / 'mlflow.db'}")
        env.setenv("TWINKLE_CACHE", str(root / "cache"))
        train_adapter(root / "base", root / "adapter")
        adapter = register_run(root, "tiny-chat", "adapter")
        merged = register_run(root, "tiny-chat-merged", "merged")
        yield {"root": root, "adapter": adapter, "merged": merged, "uri": f"sqlite:///{root / 'mlflow.db'}"}


@pytest.fixture
def store(registered, monkeypatch):
    """The registered store as the current process's tracking URI and cache."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", registered["uri"])
    monkeypatch.setenv("TWINKLE_CACHE", str(registered["root"] / "cache"))
    return registered


@pytest.fixture(scope="session")
def vl_registry(tmp_path_factory):
    """A real MLflow store holding 'tiny-vl' (a Qwen 3.5 VL LoRA adapter) and 'tiny-vl-merged'."""
    root = tmp_path_factory.mktemp("vl-registry")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{root / 'mlflow.db'}")
        env.setenv("TWINKLE_CACHE", str(root / "cache"))
        reference = register_vl(root)
        yield {"root": root, "reference": reference, "uri": f"sqlite:///{root / 'mlflow.db'}"}


@pytest.fixture
def vl_store(vl_registry, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", vl_registry["uri"])
    monkeypatch.setenv("TWINKLE_CACHE", str(vl_registry["root"] / "cache"))
    return vl_registry
