"""The resolved configuration of one multi-tenant LoRA run: written to a file, read by every worker.

Field names match the multi_lora flow's parameter models, whose defaults and help texts are the
user-facing ones; here every training field is required so that no second set of defaults exists.
"""
from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field

from twinkle_core.parallel import ParallelConfig
from twinkle_core.train.config import RunConfigFile


class TenantRunConfig(BaseModel):
    """One tenant: its data, adapter, hyper-parameters and MLflow run."""

    name: str
    train_data: Path
    lora_r: int = Field(ge=1)
    lora_alpha: int = Field(ge=1)
    lora_dropout: float = Field(ge=0.0, lt=1.0)
    lora_target_modules: list[str] | str
    optimizer: str
    lr: float = Field(gt=0)
    weight_decay: float = Field(ge=0)
    scheduler: str
    warmup_ratio: float = Field(ge=0, lt=1)
    max_grad_norm: float = Field(gt=0)
    epochs: float = Field(gt=0)
    max_steps: int | None = Field(ge=1)
    batch_size: int = Field(ge=1)
    gradient_accumulation_steps: int = Field(ge=1)
    seed: int
    mlflow_run_id: str | None = None

    def lora_config(self):
        from peft import LoraConfig

        return LoraConfig(r=self.lora_r, lora_alpha=self.lora_alpha, lora_dropout=self.lora_dropout,
                          target_modules=self.lora_target_modules, task_type="CAUSAL_LM")


class MultiLoraRunConfig(RunConfigFile):
    """Everything the workers need; paths only, no live objects."""

    model_id: str
    model_path: Path  # an HF checkpoint, or for backend megatron this project's Megatron checkpoint
    family: str
    backend: Literal["transformers", "megatron"] = "transformers"
    micro_batch_size: int = Field(1, ge=1)  # megatron: rows per micro-batch of the pipeline schedule
    checkpoint_dir: Path
    mixed_precision: str
    parallel: ParallelConfig
    max_loras: int = Field(ge=1)
    max_r: int = Field(ge=1)
    mixed_batches: bool
    tenants: list[TenantRunConfig] = Field(min_length=1)
    log_every: int = Field(1, ge=1)
    tracking_uri: str | None = None
