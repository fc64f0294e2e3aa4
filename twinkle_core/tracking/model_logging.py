"""Log a trained checkpoint as an MLflow model (the pyfunc chat model of chat_model.py) to a run.

A full model, or a LoRA adapter merged into its base, is logged whole. A LoRA adapter logged as an
adapter carries a portable reference to its base: a hub base (hf://, ms://) by id and revision, a local or
converted base (pkg://, a path, a .gguf) by the copy logged once per content hash in the
`twinkle-base-models` experiment and reused by every later adapter on the same base.
"""
from __future__ import annotations

import json
import logging
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from mlflow import MlflowClient

from twinkle_core.errors import UserError
from twinkle_core.hub import copy_processor_files, parse_id
from twinkle_core.tracking import chat_model
from twinkle_core.tracking.logger import experiment_id

logger = logging.getLogger(__name__)
REGISTER_AS = ("adapter", "merged")
BASE_EXPERIMENT = "twinkle-base-models"
BASE_ARTIFACT = "base"
BASE_HASH_TAG = "twinkle.base_content_hash"
SENTENCE_TRANSFORMERS_FILE = "modules.json"  # an embedding export: logged as sentence_transformers


@dataclass(frozen=True)
class BaseModelRef:
    """The model a checkpoint was trained from: its id as the user gave it, its local folder and hash."""

    model_id: str
    path: str
    content_hash: str
    template_source: str | None = None  # the chat template the run trained with, when not the tokenizer's

    def is_hub(self) -> bool:
        return parse_id(self.model_id).scheme in ("hf", "ms")

    def revision(self) -> str:
        """The id's @revision, else the commit a Hugging Face snapshot folder is named by, else the version
        of the distribution a pkg:// id's package comes from, else ''."""
        parsed = parse_id(self.model_id)
        if parsed.revision:
            return parsed.revision
        folder = Path(self.path)
        if parsed.scheme == "hf" and folder.parent.name == "snapshots":
            return folder.name
        if parsed.scheme == "pkg":
            from importlib.metadata import packages_distributions, version

            package = parsed.name.split("/")[0]
            distributions = packages_distributions().get(package, [])
            # several distributions may install into one package (mlflow, mlflow-tracing): prefer its namesake
            named = [d for d in distributions if d.lower().replace("-", "_") == package.lower()]
            chosen = (named or sorted(distributions) or [None])[0]
            return f"{chosen}=={version(chosen)}" if chosen else ""
        return ""


def is_chat_checkpoint(checkpoint_dir: str | Path) -> bool:
    """A causal LM directory or adapter (not an embedding export)."""
    return not (Path(checkpoint_dir) / SENTENCE_TRANSFORMERS_FILE).is_file()


def log_chat_model(client: MlflowClient, run_id: str, checkpoint_dir: str | Path, base: BaseModelRef | None,
                   register_as: str = "adapter", artifact_path: str = "model") -> dict[str, str]:
    """Log `checkpoint_dir` as an MLflow pyfunc chat model under `artifact_path`; return its base's tags."""
    if register_as not in REGISTER_AS:
        raise UserError(f"register_as={register_as!r} is not one of {list(REGISTER_AS)}")
    adapter = chat_model.is_adapter(checkpoint_dir)
    if adapter and base is None:
        raise UserError(f"{checkpoint_dir} is a LoRA adapter, but no base model was given to register it with")
    config: dict[str, str] = {"kind": "full"}
    if base is not None:
        config.update(base_model_id=base.model_id, base_revision=base.revision(), base_content_hash=base.content_hash)
    with tempfile.TemporaryDirectory(prefix="twinkle-mlflow-") as tmp:
        staged = Path(tmp) / "checkpoint"
        if adapter and register_as == "merged":
            config["kind"] = "merged"
            _merge(checkpoint_dir, base, staged)
        else:
            shutil.copytree(checkpoint_dir, staged)
            if adapter:
                config["kind"] = "adapter"
                _point_adapter_at(staged, base)
                if not base.is_hub():
                    config["base_uri"] = log_base_once(client, base)
        _write_chat_template(staged, base)
        if chat_model.is_vision_checkpoint(staged) or (base is not None and chat_model.is_vision_checkpoint(base.path)):
            config["media"] = "true"  # a vision-language model: requests may carry images
        target = Path(tmp) / "mlflow-model"
        save_chat_model(staged, target, config)
        client.log_artifacts(run_id, str(target), artifact_path)
    logger.info("logged %s as an MLflow chat model (%s)", checkpoint_dir, config["kind"])
    return {f"twinkle.{key}": value for key, value in config.items()}


def log_embedding_model(client: MlflowClient, run_id: str, export_dir: str | Path,
                        artifact_path: str = "model") -> None:
    """Log a sentence-transformers export as MLflow's sentence_transformers flavor: it loads with
    `mlflow.sentence_transformers.load_model` and, as a pyfunc, `predict(texts)` returns their embeddings."""
    import mlflow.sentence_transformers
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(export_dir), device="cpu")
    with tempfile.TemporaryDirectory(prefix="twinkle-mlflow-") as tmp:
        target = Path(tmp) / "mlflow-model"
        mlflow.sentence_transformers.save_model(
            model, str(target), input_example=["What do cats eat?"],
            pip_requirements=[*pip_requirements(), _pinned("sentence-transformers")])
        client.log_artifacts(run_id, str(target), artifact_path)
    logger.info("logged %s as an MLflow sentence_transformers model", export_dir)


def _pinned(name: str) -> str:
    from importlib.metadata import version

    return f"{name}=={version(name).split('+')[0]}"


def save_chat_model(model_dir: Path, target: Path, config: dict[str, str]) -> None:
    """An MLflow pyfunc model folder: MLmodel, the code, the checkpoint, signature, example, requirements."""
    import mlflow.pyfunc
    import pandas as pd

    media = config.get("media") == "true"
    # A one-row DataFrame, so the stored serving example is a valid /invocations body (dataframe_split + params).
    example = pd.DataFrame([{"messages": [{"role": "user", "content": "Who are you?"}]}])
    mlflow.pyfunc.save_model(
        path=str(target), python_model=chat_model.__file__, artifacts={chat_model.MODEL_ARTIFACT: str(model_dir)},
        model_config=config, signature=chat_signature(media), pip_requirements=pip_requirements(media),
        input_example=(example, {"max_new_tokens": 32}),
        # A VL model encodes request images with the project's encoder (twinkle_core.data), shipped as code.
        code_paths=[str(Path(__file__).resolve().parents[1])] if media else None,
    )


def chat_signature(media: bool = False):
    """messages: [{role, content}]; content is text, or for a vision-language model text or a content list."""
    from mlflow.models import ModelSignature
    from mlflow.types.schema import AnyType, Array, ColSpec, Object, ParamSchema, ParamSpec, Property, Schema

    message = Object([Property("role", "string"), Property("content", AnyType() if media else "string")])
    return ModelSignature(
        inputs=Schema([ColSpec(Array(message), "messages")]), outputs=Schema([ColSpec("string")]),
        params=ParamSchema([ParamSpec("max_new_tokens", "long", 64), ParamSpec("temperature", "double", 0.0)]))


def pip_requirements(media: bool = False) -> list[str]:
    """What loading the model imports, pinned to the versions it was logged with (a VL model's shipped
    twinkle_core also reads images with Pillow and videos with PyAV, and renders its chat template with Jinja)."""
    names = ["torch", "transformers", "peft", "safetensors", "huggingface_hub"]
    if media:
        names += ["pillow", "av", "jinja2"]
    return [_pinned(name) for name in names]


def log_base_once(client: MlflowClient, base: BaseModelRef) -> str:
    """`runs:/<id>/base` of the logged copy of `base` with its content hash, logging it if there is none."""
    experiment = experiment_id(client, BASE_EXPERIMENT)
    found = client.search_runs([experiment], f"tags.`{BASE_HASH_TAG}` = '{base.content_hash}' and "
                                                "attributes.status = 'FINISHED'", max_results=1)
    if found:
        return f"runs:/{found[0].info.run_id}/{BASE_ARTIFACT}"
    run = client.create_run(experiment, run_name=f"base-{base.content_hash[:12]}",
                            tags={BASE_HASH_TAG: base.content_hash, "twinkle.base_model_id": base.model_id})
    client.log_artifacts(run.info.run_id, base.path, BASE_ARTIFACT)
    client.set_terminated(run.info.run_id, "FINISHED")  # only a complete upload is ever reused
    logger.info("logged base model %s (%s) to MLflow run %s", base.model_id, base.content_hash[:12], run.info.run_id)
    return f"runs:/{run.info.run_id}/{BASE_ARTIFACT}"


def _merge(adapter_dir: str | Path, base: BaseModelRef, target: Path) -> None:
    """The adapter's weights folded into its base, saved as a plain safetensors directory."""
    model, tokenizer = chat_model.load_chat_parts(adapter_dir, base.path, dtype="auto")
    model.merge_and_unload().save_pretrained(target, safe_serialization=True)
    tokenizer.save_pretrained(target)
    copy_processor_files(base.path, target)


def _point_adapter_at(adapter_dir: Path, base: BaseModelRef) -> None:
    """The adapter names its base by id, not by this machine's cache path."""
    path = adapter_dir / chat_model.ADAPTER_CONFIG
    config = json.loads(path.read_text())
    config["base_model_name_or_path"] = base.model_id
    path.write_text(json.dumps(config, indent=2))


def _write_chat_template(model_dir: Path, base: BaseModelRef | None) -> None:
    """The template the run trained with goes into the logged tokenizer, so the served model renders the same."""
    if base is None or not base.template_source:
        return
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if tokenizer.chat_template != base.template_source:
        tokenizer.chat_template = base.template_source
        tokenizer.save_pretrained(model_dir)
