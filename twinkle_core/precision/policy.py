"""What each `mixed_precision` setting means for parameters, compute and gradient scaling.

- no:   fp32 everywhere (debugging and exact comparisons).
- bf16: trainable parameters stay fp32 (the master copy the optimizer updates); frozen base weights are
        stored in bf16 (they never receive updates, so a master copy is wasted memory and casts);
        matmuls run under bf16 autocast. On CPUs with AMX this is also the fast path.
- fp16: like bf16 with float16 compute plus a dynamic loss scaler (fp16 overflows without one).
- fp8:  needs an NVIDIA GPU (Hopper or newer) with Transformer Engine; rejected up front elsewhere.
"""
from __future__ import annotations

import contextlib
import importlib.util
from dataclasses import dataclass
from enum import Enum

import torch


class MixedPrecision(str, Enum):
    bf16 = "bf16"
    fp16 = "fp16"
    fp8 = "fp8"
    no = "no"


@dataclass(frozen=True)
class PrecisionPolicy:
    mode: MixedPrecision
    compute_dtype: torch.dtype  # dtype of matmuls (autocast)
    frozen_dtype: torch.dtype  # storage dtype of parameters that are not trained
    trainable_dtype: torch.dtype  # storage dtype of trained parameters (the optimizer's master copy)
    uses_grad_scaler: bool

    def autocast(self, device_type: str):
        """The autocast context for forward passes (a no-op for fp32)."""
        if self.compute_dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(device_type=device_type, dtype=self.compute_dtype)


def _has_transformer_engine() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def resolve_precision(mode: str | MixedPrecision, device_type: str) -> PrecisionPolicy:
    """Validate `mixed_precision` for the device and return its policy; raise with the fix if unsupported."""
    try:
        mode = MixedPrecision(mode)
    except ValueError:
        choices = ", ".join(repr(m.value) for m in MixedPrecision)
        raise ValueError(f"mixed_precision={mode!r} is not a precision; choose one of {choices}.") from None
    if mode is MixedPrecision.fp8:
        if device_type != "cuda" or not _has_transformer_engine():
            raise ValueError(
                "mixed_precision='fp8' needs an NVIDIA GPU (H100 or newer) with Transformer Engine "
                "(pip install 'twinkle-flows[te]'); "
                f"this machine has device '{device_type}'"
                f"{'' if _has_transformer_engine() else ' and no transformer_engine'}. "
                "Use mixed_precision='bf16' (recommended) or 'no'."
            )
        raise ValueError(
            "mixed_precision='fp8' is not available in the Transformers backend yet; "
            "use mixed_precision='bf16'."
        )
    if mode is MixedPrecision.no:
        return PrecisionPolicy(mode, torch.float32, torch.float32, torch.float32, False)
    dtype = torch.bfloat16 if mode is MixedPrecision.bf16 else torch.float16
    return PrecisionPolicy(mode, dtype, dtype, torch.float32, mode is MixedPrecision.fp16)
