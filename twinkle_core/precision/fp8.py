"""FP8 training on Hopper-class GPUs: linear layers compute in float8 through torchao.

torchao's Float8Linear keeps the weights in the master dtype and casts inputs, weights and output
gradients to float8 (e4m3 forward, e5m2 gradients) with dynamic per-tensor scales inside each matmul, so
the optimizer, checkpoints and PEFT adapters see ordinary parameters. The output layer and layers whose
dimensions are not multiples of 16 (the float8 GEMM needs that) stay in bf16.
"""
from __future__ import annotations

import importlib.util
import logging

import torch

logger = logging.getLogger(__name__)
FP8_MIN_CAPABILITY = (8, 9)  # Ada / Hopper and newer have float8 tensor cores


def fp8_unavailable_reason(device_type: str) -> str | None:
    """Why fp8 cannot run here (None when it can): it needs an fp8-capable GPU and torchao."""
    if device_type != "cuda" or not torch.cuda.is_available():
        return f"it needs an NVIDIA GPU with float8 tensor cores (H100/H200/L40S); this machine has device '{device_type}'"
    capability = torch.cuda.get_device_capability()
    if capability < FP8_MIN_CAPABILITY:
        return f"the GPU has compute capability {capability}, float8 needs {FP8_MIN_CAPABILITY} or newer"
    if importlib.util.find_spec("torchao") is None:
        return "torchao is not installed (pip install 'twinkle-flows[fp8]')"
    return None


def _is_fp8_friendly(module: torch.nn.Module, fqn: str, skip: set[str]) -> bool:
    if not isinstance(module, torch.nn.Linear) or fqn.split(".")[-1] in skip:
        return False
    return module.in_features % 16 == 0 and module.out_features % 16 == 0


def convert_linears_to_fp8(model: torch.nn.Module) -> int:
    """Swap eligible nn.Linear layers for torchao Float8Linear in place; return how many were converted."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    skip = {name.split(".")[-1] for name, mod in model.named_modules() if mod is output}
    before = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    convert_to_float8_training(model, config=Float8LinearConfig(),
                               module_filter_fn=lambda mod, fqn: _is_fp8_friendly(mod, fqn, skip))
    converted = sum(type(m).__name__ == "Float8Linear" for m in model.modules())
    logger.info("fp8: %d of %d linear layers compute in float8", converted, before)
    return converted
