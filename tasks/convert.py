"""convert: HF <-> Megatron checkpoints for the Megatron backend; nothing to do for Transformers."""
from __future__ import annotations

from prefect import get_run_logger, task

from tasks.refs import ModelRef


@task
def convert(model: ModelRef, backend: str) -> ModelRef:
    """Return the checkpoint the backend trains from."""
    if backend == "transformers":
        get_run_logger().info("convert: nothing to do for backend=transformers (it trains the HF checkpoint)")
        return model
    raise ValueError(f"backend={backend!r}: only 'transformers' is available in this release.")
