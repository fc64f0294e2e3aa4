"""register: log the trained model to MLflow and create a registered version (candidate / champion)."""
from __future__ import annotations

from mlflow import MlflowClient
from prefect import get_run_logger, task

from tasks.refs import CheckpointRef, DatasetRef, ModelRef
from twinkle_core.tracking import register_version, tracking_uri
from twinkle_core.tracking.lineage import version_tags
from twinkle_core.tracking.model_logging import (BaseModelRef, is_chat_checkpoint, log_chat_model,
                                                 log_embedding_model)
from twinkle_core.tracking.registry import version_of_run

ARTIFACT_PATH = "model"


@task
def register(checkpoint: CheckpointRef, name: str, mlflow_run_id: str, eval_loss: float,
             tags: dict[str, str] | None = None, metric: str = "eval_loss", higher_is_better: bool = False,
             extras: dict[str, str] | None = None, base: ModelRef | None = None, dataset: DatasetRef | None = None,
             register_as: str = "adapter") -> dict:
    """Log the checkpoint as an MLflow model and register it; champion moves only if it wins.

    A causal LM is logged as the pyfunc chat model (a LoRA adapter with a portable reference to `base`,
    or merged into it when `register_as="merged"`); an embedding export as MLflow's
    sentence_transformers flavor. `eval_loss` is the
    run's `metric` (lower wins unless `higher_is_better`); `tags` (e.g. the Prefect flow run), the base,
    the `dataset` and the held-out metrics go on the version; `extras` (artifact path -> folder) are
    uploaded beside it, e.g. the LoRA adapter of a merged embedding model. A retry for a run that already
    has its version (a crash after registering) reuses that version.
    """
    logger = get_run_logger()
    client = MlflowClient(tracking_uri())
    reference = None if base is None else BaseModelRef(base.model_id, base.path, base.content_hash,
                                                       base.template_source)
    base_tags = {} if reference is None else {"twinkle.base_model_id": reference.model_id,
                                              "twinkle.base_revision": reference.revision(),
                                              "twinkle.base_content_hash": reference.content_hash}
    if version_of_run(client, name, mlflow_run_id) is not None:
        logger.info("MLflow run %s already has a version of %s: not logging the model again", mlflow_run_id, name)
    elif is_chat_checkpoint(checkpoint.path):
        base_tags |= log_chat_model(client, mlflow_run_id, checkpoint.path, reference, register_as, ARTIFACT_PATH)
    else:
        log_embedding_model(client, mlflow_run_id, checkpoint.path, ARTIFACT_PATH)
    for artifact_path, folder in (extras or {}).items():
        client.log_artifacts(mlflow_run_id, folder, artifact_path)
    result = register_version(client, name, mlflow_run_id, ARTIFACT_PATH, eval_loss, metric, higher_is_better)
    all_tags = version_tags(client, mlflow_run_id, base_tags, dataset and dataset.dataset_id,
                            dataset and dataset.content_hash, tags)
    for key, value in all_tags.items():
        client.set_model_version_tag(name, result.version, key, value)
    logger.info("registered %s version %s: %s", name, result.version, result.decision())
    return {"name": result.name, "version": result.version, "promoted": result.promoted,
            "decision": result.decision(), "champion_version": result.champion_version,
            "champion_loss": result.champion_loss, "chat_model": is_chat_checkpoint(checkpoint.path)}
