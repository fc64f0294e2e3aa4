"""convert: HF <-> Megatron checkpoints for the Megatron backend (cached by content hash); nothing for Transformers."""
from __future__ import annotations

from pathlib import Path

from prefect import get_run_logger, task

from tasks.refs import ModelRef
from twinkle_core.convert.cached import convert_cached, copy_to, megatron_checkpoint_hash
from twinkle_core.convert.megatron_checkpoint import read_checkpoint_info
from twinkle_core.megatron.parallel_state import MegatronParallel

BACKENDS = ("transformers", "megatron")


@task
def convert(model: ModelRef, backend: str, tp: int = 1, pp: int = 1, timeout_s: float | None = None) -> ModelRef:
    """Return the checkpoint the backend trains from: the HF one, or its Megatron conversion."""
    if backend == "transformers":
        get_run_logger().info("convert: nothing to do for backend=transformers (it trains the HF checkpoint)")
        return model
    if backend != "megatron":
        raise ValueError(f"backend={backend!r}: choose one of {BACKENDS}.")
    return to_megatron.fn(model, tp, pp, timeout_s)


@task
def to_megatron(model: ModelRef, tp: int = 1, pp: int = 1, timeout_s: float | None = None) -> ModelRef:
    """HF → Megatron dist checkpoint written at tp × pp (loadable at any layout)."""
    log = get_run_logger()
    result = convert_cached(model.path, model.content_hash, "megatron", MegatronParallel(tp, pp), log.info, timeout_s)
    log.info("%s as a Megatron checkpoint: %s", model.model_id, result.path)
    return model.model_copy(update=dict(path=str(result.path), content_hash=result.content_hash,
                                        family=result.family, backend="megatron"))


@task
def to_hf(checkpoint: ModelRef, tp: int = 1, pp: int = 1, timeout_s: float | None = None) -> ModelRef:
    """Megatron checkpoint → HF directory (safetensors shards, index, config, tokenizer)."""
    log = get_run_logger()
    result = convert_cached(checkpoint.path, checkpoint.content_hash, "hf", MegatronParallel(tp, pp), log.info,
                            timeout_s)
    log.info("%s as a Hugging Face checkpoint: %s", checkpoint.model_id, result.path)
    return checkpoint.model_copy(update=dict(path=str(result.path), content_hash=result.content_hash,
                                             family=result.family, backend="transformers"))


@task
def open_megatron_checkpoint(path: str) -> ModelRef:
    """A Megatron checkpoint directory (written by the convert flow or training) as a ModelRef."""
    info = read_checkpoint_info(path)
    return ModelRef(model_id=path, path=str(Path(path).resolve()), content_hash=megatron_checkpoint_hash(path),
                    family=info["family"], backend="megatron")


@task
def place_output(model: ModelRef, output: str) -> str:
    """Copy a (cached) conversion to the folder the user asked for."""
    return str(copy_to(Path(model.path), output))
