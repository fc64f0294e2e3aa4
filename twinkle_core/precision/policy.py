"""What each `mixed_precision` setting means for parameters, compute and gradient scaling.

- auto: bf16 where the hardware computes bf16 natively (CUDA GPUs with bf16 support; CPUs with AVX512-BF16
        or AMX), else fp16 on older GPUs and fp32 on other CPUs: without bf16 units a CPU emulates bf16
        matmuls ~100x slower than fp32 (measured 0.9-1.2 GFLOP/s vs 129-135 on an AVX2 EPYC, 2 threads).
- no:   fp32 everywhere (debugging and exact comparisons).
- bf16: trainable parameters stay fp32 (the master copy the optimizer updates); frozen base weights are
        stored in bf16 (they never receive updates, so a master copy is wasted memory and casts);
        matmuls run under bf16 autocast. On CPUs with AMX this is also the fast path; on CPUs without
        bf16 units it is correct but very slow (see auto).
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
    auto = "auto"
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


def native_bf16(device_type: str) -> bool:
    """Whether `device_type` computes bf16 matmuls in hardware (not emulated)."""
    if device_type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported(including_emulation=False)
    if device_type == "cpu":
        return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    return False


def auto_precision(device_type: str) -> MixedPrecision:
    """What `mixed_precision='auto'` means on `device_type`: bf16 where it is native, else fp16 (GPU) or fp32."""
    if native_bf16(device_type):
        return MixedPrecision.bf16
    return MixedPrecision.fp16 if device_type == "cuda" else MixedPrecision.no


def resolve_precision(mode: str | MixedPrecision, device_type: str, check_fp8: bool = True) -> PrecisionPolicy:
    """Validate `mixed_precision` for the device and return its policy; raise with the fix if unsupported.

    `check_fp8=False`: the caller computes fp8 in its own layers and checks that itself (the Megatron backend:
    Transformer Engine, twinkle_core.megatron.engine), so torchao's requirements do not apply."""
    try:
        mode = MixedPrecision(mode)
    except ValueError:
        choices = ", ".join(repr(m.value) for m in MixedPrecision)
        raise ValueError(f"mixed_precision={mode!r} is not a precision; choose one of {choices}.") from None
    if mode is MixedPrecision.auto:
        mode = auto_precision(device_type)
    if mode is MixedPrecision.fp8:
        reason = fp8_unavailable_reason(device_type) if check_fp8 else None
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
