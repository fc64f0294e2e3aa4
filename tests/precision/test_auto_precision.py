"""mixed_precision='auto': bf16 only where the hardware computes it natively."""
import torch

from twinkle_core import precision
from twinkle_core.precision import MixedPrecision, resolve_precision


def test_auto_on_this_cpu_follows_its_bf16_units():
    native = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    policy = resolve_precision("auto", "cpu")
    assert policy.mode is (MixedPrecision.bf16 if native else MixedPrecision.no)
    assert policy.compute_dtype == (torch.bfloat16 if native else torch.float32)
    assert not policy.uses_grad_scaler


def test_auto_on_a_gpu_without_bf16_is_fp16_with_a_scaler(monkeypatch):
    monkeypatch.setattr(precision.policy, "native_bf16", lambda device_type: False)
    policy = resolve_precision("auto", "cuda")
    assert policy.mode is MixedPrecision.fp16 and policy.uses_grad_scaler


def test_auto_where_bf16_is_native_is_bf16_with_fp32_masters(monkeypatch):
    monkeypatch.setattr(precision.policy, "native_bf16", lambda device_type: True)
    policy = resolve_precision("auto", "cpu")
    assert (policy.mode, policy.compute_dtype, policy.trainable_dtype) == (MixedPrecision.bf16, torch.bfloat16,
                                                                          torch.float32)
