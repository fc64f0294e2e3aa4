"""Precision policies: auto / bf16 / fp16 / fp8 / no."""
from twinkle_core.precision.policy import (MixedPrecision, PrecisionPolicy, auto_precision, native_bf16,
                                          resolve_precision)

__all__ = ["MixedPrecision", "PrecisionPolicy", "auto_precision", "native_bf16", "resolve_precision"]
