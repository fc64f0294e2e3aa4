"""Open a registered model version for training on, chatting or exporting.

    model, tokenizer = load_registered("twinkle-SmolLM2-135M-Instruct.Q4_1", "champion")

`model` is a transformers model, or a PeftModel (the adapter on its base) for a version registered as an
adapter. `models:/NAME@alias` and `models:/NAME/VERSION` name a version on the command line.
"""
from __future__ import annotations

import contextlib
import re
import tempfile
from pathlib import Path

from mlflow import MlflowClient
from mlflow.entities.model_registry import ModelVersion
from mlflow.exceptions import MlflowException

from twinkle_core.errors import UserError
from twinkle_core.tracking import chat_model
from twinkle_core.tracking.logger import tracking_uri

_MODEL_URI = re.compile(r"models:/(?P<name>[^@/]+)(@(?P<alias>[\w-]+)|/(?P<version>\d+))$")


class RegisteredModelNotFound(UserError):
    """The name, alias or version names nothing in the registry."""


def parse_model_uri(uri: str) -> tuple[str, str]:
    """`models:/NAME@alias` or `models:/NAME/VERSION` -> (name, alias or version)."""
    match = _MODEL_URI.match(uri.strip())
    if not match:
        raise RegisteredModelNotFound(f"--model {uri!r}: expected models:/NAME@ALIAS (e.g. models:/my-model@champion) "
                                      "or models:/NAME/VERSION")
    return match["name"], match["alias"] or match["version"]


def find_version(name: str, alias: str = "champion", client: MlflowClient | None = None) -> ModelVersion:
    """The version `alias` (or a version number) of `name`; one clear error when either does not exist."""
    client = client or MlflowClient(tracking_uri())
    try:
        registered = client.get_registered_model(name)
    except MlflowException:
        names = sorted(m.name for m in client.search_registered_models(max_results=50))
        raise RegisteredModelNotFound(f"no registered model {name!r} in {tracking_uri()}; registered models: "
                                      f"{', '.join(names) or 'none'}") from None
    try:
        if alias.isdigit():
            return client.get_model_version(name, alias)
        return client.get_model_version_by_alias(name, alias)
    except MlflowException:
        aliases = ", ".join(f"{a}={v}" for a, v in sorted(registered.aliases.items())) or "none"
        raise RegisteredModelNotFound(f"registered model {name!r} has no alias or version {alias!r}; its aliases: "
                                      f"{aliases}") from None


def download_version(version: ModelVersion, target: str | Path) -> tuple[Path, dict]:
    """The version's MLflow model into `target`: (its checkpoint folder, its model config)."""
    import mlflow.artifacts
    from mlflow.models import Model

    local = Path(mlflow.artifacts.download_artifacts(artifact_uri=version.source, dst_path=str(target)))
    flavor = Model.load(local).flavors.get("python_function", {})
    if chat_model.MODEL_ARTIFACT not in flavor.get("artifacts", {}):
        raise RegisteredModelNotFound(f"version {version.version} of {version.name!r} is not a Twinkle chat model "
                                      "(registered before models were logged as MLflow models, or an embedding model)")
    return local / flavor["artifacts"][chat_model.MODEL_ARTIFACT]["path"], dict(flavor.get("config") or {})


@contextlib.contextmanager
def opened_registered(name: str, alias: str = "champion", dtype=None):
    """(model, tokenizer, folder) of a registered version, the model as `load_registered` gives it; `folder`
    holds the config, tokenizer and processor files (the base's for an adapter) while the block runs."""
    version = find_version(name, alias)
    with tempfile.TemporaryDirectory(prefix="twinkle-registered-") as tmp:
        model_dir, config = download_version(version, tmp)
        base_dir = chat_model.fetch_base(config) if chat_model.is_adapter(model_dir) else None
        model, tokenizer = chat_model.load_chat_parts(model_dir, base_dir, dtype)
        yield model, tokenizer, Path(base_dir or model_dir)


def load_registered(name: str, alias: str = "champion", dtype=None):
    """(model, tokenizer) of a registered version: the PeftModel on its base for an adapter version."""
    with opened_registered(name, alias, dtype) as (model, tokenizer, _):
        return model, tokenizer
