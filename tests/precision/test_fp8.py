"""fp8: rejected with the reason where it cannot run; the layer conversion itself is checked on CPU."""
import pytest
import torch

from tiny_models import make_tiny_causal_lm
from twinkle_core.precision import resolve_precision
from twinkle_core.precision.fp8 import _is_fp8_friendly


def test_fp8_without_a_gpu_fails_before_anything_runs_and_says_why():
    with pytest.raises(ValueError) as err:
        resolve_precision("fp8", "cpu")
    message = str(err.value)
    assert "float8 tensor cores" in message and "'cpu'" in message and "bf16" in message


def test_float8_takes_every_projection_but_the_output_layer_and_odd_shapes():
    """The layer choice of convert_linears_to_fp8 (the conversion itself ran on an H200: see the README)."""
    model, _ = make_tiny_causal_lm("llama")
    chosen = {fqn for fqn, mod in model.named_modules() if _is_fp8_friendly(mod, fqn, {"lm_head"})}
    linears = {fqn for fqn, mod in model.named_modules() if isinstance(mod, torch.nn.Linear)}
    assert chosen == linears - {"lm_head"} and len(chosen) == 14  # 7 projections x 2 layers
    assert not _is_fp8_friendly(torch.nn.Linear(64, 8), "x.proj", set())  # float8 GEMMs need multiples of 16
