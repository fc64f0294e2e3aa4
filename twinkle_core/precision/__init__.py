"""Precision policies: bf16 / fp16 / fp8 / no."""
from twinkle_core.precision.policy import MixedPrecision, PrecisionPolicy, resolve_precision

__all__ = ["MixedPrecision", "PrecisionPolicy", "resolve_precision"]
