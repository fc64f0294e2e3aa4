"""The verbs every training backend implements, so one recipe drives any of them.

TransformersModel and MegatronModel both satisfy `TrainableModel` (tests/models/test_backends.py checks
it); the multi-tenant models add the tenant (`adapter_name=`) to the same verbs. A new backend implements
these, registers a builder in twinkle_core.models.backends, and every recipe and flow can use it.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class TrainableModel(Protocol):
    tokenizer: Any
    precision: Any  # its PrecisionPolicy (compute dtype, loss scaling)
    device: Any

    @property
    def hf_dir(self) -> Path:
        """The Hugging Face directory whose config describes the model."""

    @property
    def data_parallel_size(self) -> int: ...

    @property
    def data_parallel_rank(self) -> int: ...

    def add_adapter_to_model(self, name: str, config: Any, gradient_accumulation_steps: int = 1) -> None: ...

    def trainable_parameters(self) -> list: ...

    def set_optimizer(self, optimizer_cls: str = "AdamW", lr: float = 1e-4, weight_decay: float = 0.0,
                      gradient_accumulation_steps: int | None = None) -> None: ...

    def set_lr_scheduler(self, scheduler_cls: str = "CosineWarmupScheduler", num_warmup_steps: int = 0,
                         num_training_steps: int = 1) -> None: ...

    def forward_backward(self, inputs: Any) -> float:
        """Forward and backward this rank's rows under the model's objective; their mean loss."""

    def forward_only(self, inputs: Any) -> float: ...

    def clip_grad_and_step(self, max_grad_norm: float | None = 1.0) -> bool:
        """Step at the end of an accumulation; True when an optimizer step was taken."""

    def calculate_metric(self, is_training: bool = True) -> dict[str, float]: ...

    def save(self, name: str, output_dir: str | Path) -> Path: ...

    def load(self, name: str, output_dir: str | Path) -> None: ...

    def export(self, name: str, output_dir: str | Path) -> Path:
        """The trained result as a Hugging Face directory or PEFT adapter (what evaluation and the registry read)."""

    def save_training_state(self, checkpoint_dir: str | Path, progress: dict, keep: int = 2) -> None:
        """A resumable training state under checkpoint_dir (published when complete, with checksums; the newest
        `keep` are kept: twinkle_core.models.state_dirs)."""

    def load_training_state(self, checkpoint_dir: str | Path, settings: dict) -> dict | None:
        """Restore the newest intact training state saved with these settings; its progress, or None."""

    def close(self) -> None: ...
