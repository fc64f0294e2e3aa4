"""What each `mixed_precision` setting means for parameters, compute and gradient scaling.

- no:   fp32 everywhere (debugging and exact comparisons).
- bf16: trainable parameters stay fp32 (the master copy the optimizer updates); frozen base weights are
        stored in bf16 (they never receive updates, so a master copy is wasted memory and casts);
        matmuls run under bf16 autocast. On CPUs with AMX this is also the fast path.
- fp16: like bf16 with float16 compute plus a dynamic loss scaler (fp16 overflows without one).
- fp8:  bf16 as above, plus float8 matmuls in the linear layers (torchao Float8Linear; see fp8.py) on
        GPUs with float8 tensor cores. Without one (or without torchao) it is rejected before anything runs.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from enum import Enum

import torch

from twinkle_core.precision.fp8 import fp8_unavailable_reason


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
    fp8_linears: bool = False  # swap linear layers for float8 ones (fp8.py)

    def autocast(self, device_type: str):
        """The autocast context for forward passes (a no-op for fp32)."""
        if self.compute_dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(device_type=device_type, dtype=self.compute_dtype)


def resolve_precision(mode: str | MixedPrecision, device_type: str) -> PrecisionPolicy:
    """Validate `mixed_precision` for the device and return its policy; raise with the fix if unsupported."""
    try:
        mode = MixedPrecision(mode)
    except ValueError:
        choices = ", ".join(repr(m.value) for m in MixedPrecision)
        raise ValueError(f"mixed_precision={mode!r} is not a precision; choose one of {choices}.") from None
    if mode is MixedPrecision.fp8:
        reason = fp8_unavailable_reason(device_type)
        if reason:
            raise ValueError(
                f"mixed_precision='fp8' cannot run here: {reason}. fp8 needs an H100-class GPU with torchao "
                "(or Transformer Engine for the Megatron backend). Use mixed_precision='bf16' (recommended) or 'no'."
            )
        return PrecisionPolicy(mode, torch.bfloat16, torch.bfloat16, torch.float32, False, fp8_linears=True)
    if mode is MixedPrecision.no:
        return PrecisionPolicy(mode, torch.float32, torch.float32, torch.float32, False)
    dtype = torch.bfloat16 if mode is MixedPrecision.bf16 else torch.float16
    return PrecisionPolicy(mode, dtype, dtype, torch.float32, mode is MixedPrecision.fp16)
