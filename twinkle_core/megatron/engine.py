"""Which layer implementation megatron-core builds: its local spec (plain torch) or Transformer Engine's.

    impl = resolve_transformer_impl(None)      # "transformer_engine" with CUDA and TE importable, else "local"
    transformer_engine_problem()                # None, or why TE cannot run here (for the pre-launch rules)
    fp8_settings("tensorwise")                  # the TransformerConfig fields of TE's fp8 recipe

The local spec runs everywhere (on CPU through the CPU device mode) and is what every CPU test trains.
Transformer Engine is CUDA-only: it brings the fused attention kernels (needed for context parallelism and
packed `thd` sequences), fused norms+linears and fp8. The choice is made once, before any process starts
(twinkle_core.models.backends' rules) and again by MegatronModel for library users.
"""
from __future__ import annotations

import functools

TRANSFORMER_IMPLS = ("local", "transformer_engine")
FP8_RECIPES = ("tensorwise", "delayed")
FP8_MIN_CAPABILITY = (8, 9)  # float8 tensor cores: Ada, Hopper and newer


@functools.lru_cache(maxsize=None)
def transformer_engine_problem() -> str | None:
    """Why Transformer Engine cannot run on this machine (None when it can): no CUDA device, or TE absent."""
    import torch

    if not torch.cuda.is_available():
        return "Transformer Engine needs a CUDA GPU and this machine has none"
    try:
        import transformer_engine.pytorch  # noqa: F401  (a present but broken install fails here, not later)
    except Exception as err:  # ImportError, or TE's own check of its core library and CUDA
        return f"Transformer Engine does not import here ({type(err).__name__}: {err}); install it with " \
               "pip install 'twinkle-flows[te]' on a CUDA machine"
    return None


def resolve_transformer_impl(requested: str | None, lora: bool = False) -> str:
    """The implementation to build: `requested`, or (None) Transformer Engine where it runs, else local.

    `lora`: the run trains LoRA adapters, which hook the local spec's parallel linears (TE fuses the norms into
    linear_qkv / linear_fc1, so a hook there would see the un-normalised input): None resolves to local.
    Raises ValueError naming the option when `requested` cannot run here.
    """
    if requested is None:
        return "local" if lora or transformer_engine_problem() else "transformer_engine"
    if requested not in TRANSFORMER_IMPLS:
        raise ValueError(f"transformer_impl={requested!r} is not a megatron layer implementation; choose one of "
                         f"{', '.join(map(repr, TRANSFORMER_IMPLS))} (or leave it empty for the default).")
    if requested == "transformer_engine" and lora:
        raise ValueError("transformer_impl='transformer_engine' with LoRA: megatron's LoRA here hooks the local "
                         "spec's parallel linears, and Transformer Engine fuses the norms into linear_qkv and "
                         "linear_fc1; use transformer_impl='local' (or leave it empty), or train without LoRA.")
    problem = transformer_engine_problem() if requested == "transformer_engine" else None
    if problem:
        raise ValueError(f"transformer_impl='transformer_engine': {problem}; use transformer_impl='local' (runs on "
                         "CPU and GPU), or leave it empty to pick Transformer Engine only where it runs.")
    return requested


def fp8_problem() -> str | None:
    """Why megatron cannot train in fp8 here (None when it can): fp8 runs in TE's layers on float8 tensor cores."""
    import torch

    problem = transformer_engine_problem()
    if problem:
        return problem
    capability = torch.cuda.get_device_capability()
    if capability < FP8_MIN_CAPABILITY:
        return f"the GPU has compute capability {capability}; float8 tensor cores need {FP8_MIN_CAPABILITY} or newer"
    return None


def fp8_settings(recipe: str) -> dict:
    """TransformerConfig fields for fp8 through TE: e4m3 forward, e5m2 gradients ('hybrid'), and the recipe.

    tensorwise: current scaling, each tensor scaled by its own amax at the time it is cast (no history to
    warm up; TE's Float8CurrentScaling). delayed: scales from a window of past amaxes (TE's DelayedScaling;
    megatron's usual settings: 1024 steps of history, the maximum over them).
    """
    if recipe not in FP8_RECIPES:
        raise ValueError(f"fp8_recipe={recipe!r}: choose one of {', '.join(map(repr, FP8_RECIPES))}.")
    settings = dict(fp8="hybrid", fp8_recipe=recipe)
    if recipe == "delayed":
        settings.update(fp8_amax_history_len=1024, fp8_amax_compute_algo="max", fp8_margin=0)
    return settings
