"""The resolved configuration of one multi-tenant LoRA run: written to a file, read by every worker.

Composed of the same field groups as the multi_lora flow's parameter models (twinkle_core.config.fields).
"""
from __future__ import annotations

from pathlib import Path

from pydantic import Field

from twinkle_core.config.fields import (BackendName, CheckpointFields, LoopFields, LoraFields, MaxLoras, MaxR,
                                        MicroBatchSize, MixedBatches, MixedPrecisionMode, ModelId, ModelLoadFields,
                                        OptimizerFields, TenantName)
from twinkle_core.parallel import ParallelConfig
from twinkle_core.train.config import RunConfigFile


class TenantRunConfig(LoraFields, OptimizerFields, LoopFields):
    """One tenant: its data, adapter, hyper-parameters and MLflow run."""

    name: TenantName
    train_data: Path
    mlflow_run_id: str | None = None


class MultiLoraRunConfig(RunConfigFile, ModelLoadFields, CheckpointFields):
    """Everything the workers need; paths only, no live objects."""

    model_id: ModelId
    model_path: Path  # an HF checkpoint, or for backend megatron this project's Megatron checkpoint
    backend: BackendName = "transformers"
    micro_batch_size: MicroBatchSize = 1
    checkpoint_dir: Path
    mixed_precision: MixedPrecisionMode
    parallel: ParallelConfig
    max_loras: MaxLoras  # resolved by the flow: never empty here
    max_r: MaxR
    mixed_batches: MixedBatches
    tenants: list[TenantRunConfig] = Field(min_length=1)
    log_every: int = Field(1, ge=1)
    tracking_uri: str | None = None
