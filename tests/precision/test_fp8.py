"""fp8: rejected with the reason where it cannot run; the layer conversion itself is checked on CPU."""
import pytest
import torch

from tiny_models import make_tiny_causal_lm
from twinkle_core.precision import resolve_precision
from twinkle_core.precision.fp8 import convert_linears_to_fp8


def test_fp8_without_a_gpu_fails_before_anything_runs_and_says_why():
    with pytest.raises(ValueError) as err:
        resolve_precision("fp8", "cpu")
    message = str(err.value)
    assert "float8 tensor cores" in message and "'cpu'" in message and "bf16" in message


def test_linears_become_float8_except_the_output_layer():
    model, _ = make_tiny_causal_lm("llama")
    linears = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    converted = convert_linears_to_fp8(model)
    assert converted == linears - 1  # every projection of the 2 layers; lm_head stays
    assert type(model.lm_head) is torch.nn.Linear
    assert type(model.model.layers[0].self_attn.q_proj).__name__ == "Float8Linear"
