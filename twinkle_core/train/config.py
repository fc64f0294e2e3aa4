"""The resolved configuration of one training run: written to a file, read by every worker.

Composed of the same field groups as the flows' parameter models (twinkle_core.config.fields), so a field
has one type, one bound and one help text wherever it appears; the flow always writes every value.
"""
from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, Field

from twinkle_core.config.fields import (AdapterFields, BackendName, BatchingFields, CheckpointEvery, KeepCheckpoints,
                                        LoopFields, MixedPrecisionMode, ModelId, ModelLoadFields, OptimizerFields,
                                        RouterAuxLossCoef)
from twinkle_core.parallel import ParallelConfig


class RunConfigFile(BaseModel):
    """A run configuration that the launching task writes and every worker reads back."""

    def write(self, path: Path) -> Path:
        path.write_text(self.model_dump_json(indent=2))
        return path

    @classmethod
    def read(cls, path: str | Path):
        return cls.model_validate_json(Path(path).read_text())


class TrainRunConfig(RunConfigFile, AdapterFields, OptimizerFields, BatchingFields, LoopFields, ModelLoadFields):
    """Everything a worker needs; paths only, no live objects."""

    model_id: ModelId
    backend: BackendName = "transformers"  # megatron: model_path is a Megatron checkpoint or an HF dir
    objective: str = "causal_lm"  # a registered training objective (twinkle_core.objectives)
    objective_options: dict = Field(default_factory=dict)  # its own options (e.g. infonce: temperature, pooling)
    model_path: Path
    train_data: Path
    checkpoint_dir: Path
    adapter_name: str = "default"
    mixed_precision: MixedPrecisionMode
    parallel: ParallelConfig
    router_aux_loss_coef: RouterAuxLossCoef = None
    log_every: int = Field(1, ge=1)
    checkpoint_every: CheckpointEvery = None
    keep_checkpoints: KeepCheckpoints = 2
    tracking_uri: str | None = None
    mlflow_run_id: str | None = None
