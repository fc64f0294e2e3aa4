"""Convert a checkpoint alone: Hugging Face → Megatron-Core, or a Megatron checkpoint → Hugging Face.

    python -m flows.convert --model-id hf://Qwen/Qwen2.5-0.5B --to megatron --tp 2 --output qwen-mcore
    python -m flows.convert --model-id qwen-mcore --to hf --output qwen-hf
    python -m flows.convert --help

Conversions are cached by content hash (the same source and settings are converted once); `--output`
receives a copy. A Megatron checkpoint is written at the given tp × pp but loads at any layout.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Literal

from prefect import flow, get_run_logger
from pydantic import BaseModel, Field, model_validator

from flows.cli import parse_args, report_user_errors
from flows.local_server import end_server_with_this_process
from tasks.convert import open_megatron_checkpoint, place_output, to_hf, to_megatron
from tasks.download import download_model
from twinkle_core.config.fields import ModelId, TimeoutMinutes
from twinkle_core.convert import is_megatron_checkpoint
from twinkle_core.families import check_model_id


class ConvertConfig(BaseModel):
    """Parameters of the convert flow (the Prefect UI form and the CLI options)."""

    model_id: ModelId
    to: Literal["megatron", "hf"] = Field("megatron", description="megatron (a model id → Megatron-Core dist checkpoint) or hf (a Megatron checkpoint folder written by --to megatron → HF safetensors).")
    tp: int = Field(1, ge=1, description="Tensor-parallel size of the conversion processes (the Megatron checkpoint loads at any layout).")
    pp: int = Field(1, ge=1, description="Pipeline-parallel size of the conversion processes.")
    output: str | None = Field(None, description="Folder that receives a copy of the result (empty: only the cache).")
    timeout_minutes: TimeoutMinutes = 60

    @model_validator(mode="after")
    def _check_source(self) -> "ConvertConfig":
        if self.to == "hf" and not is_megatron_checkpoint(self.model_id):
            raise ValueError(f"model_id={self.model_id!r} with to='hf': expected a Megatron checkpoint folder "
                             "written by `python -m flows.convert --to megatron`; an HF model needs no conversion.")
        if self.to == "megatron":
            check_model_id(self.model_id)
        if self.output and Path(self.output).exists() and any(Path(self.output).iterdir()):
            raise ValueError(f"output={self.output!r} exists and is not empty; choose a new folder.")
        return self


@flow(name="convert")
def convert_checkpoint(config: ConvertConfig) -> dict:
    """Convert `config.model_id` to the other format and place it at `config.output`."""
    timeout_s = config.timeout_minutes * 60
    if config.to == "megatron":
        result = to_megatron(download_model(config.model_id), config.tp, config.pp, timeout_s)
    else:
        result = to_hf(open_megatron_checkpoint(config.model_id), config.tp, config.pp, timeout_s)
    path = place_output(result, config.output) if config.output else result.path
    get_run_logger().info("converted %s to %s: %s", config.model_id, config.to, path)
    return {"path": path, "cached": result.path, "content_hash": result.content_hash, "family": result.family}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(ConvertConfig, argv, description=__doc__.splitlines()[0])
    end_server_with_this_process()
    result = report_user_errors(lambda: convert_checkpoint(args.config), "convert", args.debug)
    if result is None:
        return 1
    print(result["path"], flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
