"""The resolved configuration of one training run: written to a file, read by every worker.

Field names match the flows' parameter models, whose defaults and help texts are the user-facing ones;
here every training field is required so that no second set of defaults exists.
"""
from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, Field

from twinkle_core.parallel import ParallelConfig


class RunConfigFile(BaseModel):
    """A run configuration that the launching task writes and every worker reads back."""

    def write(self, path: Path) -> Path:
        path.write_text(self.model_dump_json(indent=2))
        return path

    @classmethod
    def read(cls, path: str | Path):
        return cls.model_validate_json(Path(path).read_text())


class TrainRunConfig(RunConfigFile):
    """Everything a worker needs; paths only, no live objects."""

    model_id: str
    backend: str = "transformers"  # or "megatron" (model_path is then a Megatron checkpoint or an HF dir)
    model_path: Path
    family: str
    train_data: Path
    checkpoint_dir: Path
    adapter_name: str = "default"
    mixed_precision: str
    parallel: ParallelConfig
    use_lora: bool
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
    router_aux_loss_coef: float | None = Field(ge=0)
    log_every: int = Field(1, ge=1)
    checkpoint_every: int | None = Field(None, ge=1)  # steps between resumable training states (None: never)
    tracking_uri: str | None = None
    mlflow_run_id: str | None = None

    def lora_config(self):
        """The PEFT LoraConfig these settings describe."""
        from peft import LoraConfig

        return LoraConfig(r=self.lora_r, lora_alpha=self.lora_alpha, lora_dropout=self.lora_dropout,
                          target_modules=self.lora_target_modules, task_type="CAUSAL_LM")
