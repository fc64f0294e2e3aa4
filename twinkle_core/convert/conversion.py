"""Whole conversions, run by every rank of a torchrun job (or by one process): HF → Megatron and back.

    HF dir  --convert_hf_to_megatron(tp, pp)-->  Megatron checkpoint dir  --convert_megatron_to_hf-->  HF dir

Each rank builds only its part of the model (`build_gpt_model` at the requested layout), fills it from
the source (slices of the HF safetensors, or the dist checkpoint resharded to this layout), and writes its
part. What may be converted is decided before anything is built: a tested family not marked Megatron-capable
is refused with the registry's reason; any other model converts when its config and tensor names fit the
bridge's table (else the refusal names the config key or tensors that do not). `python -m twinkle_core.convert`
is the command-line entry.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoConfig

from twinkle_core.convert.bridge import CheckpointMismatchError, check_tensor_names, export_hf_weights, load_hf_weights
from twinkle_core.convert.megatron_checkpoint import (HF_DIR, copy_hf_side_files, load_megatron_checkpoint,
                                                      read_checkpoint_info, save_megatron_checkpoint)
from twinkle_core.errors import UserError
from twinkle_core.families import family_for_model_dir
from twinkle_core.megatron.model_builder import UnsupportedArchitectureError, build_gpt_model, check_architecture
from twinkle_core.megatron.parallel_state import MegatronParallel, initialize_megatron_parallel

logger = logging.getLogger(__name__)


class NotMegatronCapableError(UserError):
    """A model family the HF <-> Megatron bridge cannot express."""


@dataclass(frozen=True)
class LoadedModel:
    model: object  # this rank's megatron GPTModel
    hf_config: object
    family: str
    dtype: torch.dtype
    seconds: dict[str, float]  # build (groups + model) and read (weights), for the benchmark and logs


@dataclass(frozen=True)
class Conversion:
    path: Path
    seconds: dict[str, float]  # build, read, write


def checkpoint_dtype(hf_config) -> torch.dtype:
    """The dtype the HF config says its weights are in (float32 when it says nothing)."""
    dtype = getattr(hf_config, "dtype", None) or torch.float32
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype


def megatron_family(hf_dir: str | Path) -> str:
    """The registry family of an HF directory, checked to be Megatron-capable.

    A tested family says so in the registry; for an untested one the bridge's table decides: its config
    and its tensor names must fit a Llama-style GPTModel (else the refusal names what does not fit).
    """
    family = family_for_model_dir(hf_dir)
    if family.tested and not family.megatron:
        raise NotMegatronCapableError(
            f"{hf_dir}: family {family.title!r} ({', '.join(family.model_types)}) cannot be converted to "
            f"megatron-core: {family.notes}. Use backend='transformers' for it.")
    hf_config = AutoConfig.from_pretrained(hf_dir)
    try:
        check_architecture(hf_config)
        check_tensor_names(hf_dir, hf_config)
    except (UnsupportedArchitectureError, CheckpointMismatchError) as err:
        raise NotMegatronCapableError(f"{hf_dir}: cannot be converted to megatron-core: {err}") from err
    return family.name


def load_hf_as_megatron(hf_dir: str | Path, layout: MegatronParallel = MegatronParallel(),
                        dtype: torch.dtype | None = None) -> LoadedModel:
    """This rank's part of the megatron model, filled from the HF checkpoint (all ranks call this)."""
    family = megatron_family(hf_dir)
    hf_config = AutoConfig.from_pretrained(hf_dir)
    dtype = dtype or checkpoint_dtype(hf_config)
    start = time.perf_counter()
    initialize_megatron_parallel(layout)
    model = build_gpt_model(hf_config, layout, dtype)
    built = time.perf_counter()
    load_hf_weights(model, hf_config, hf_dir)
    seconds = {"build": built - start, "read": time.perf_counter() - built}
    return LoadedModel(model, hf_config, family, dtype, seconds)


def load_megatron_as_megatron(checkpoint_dir: str | Path,
                              layout: MegatronParallel = MegatronParallel()) -> LoadedModel:
    """This rank's part of the model in a Megatron checkpoint, resharded to `layout`."""
    info = read_checkpoint_info(checkpoint_dir)
    hf_config = AutoConfig.from_pretrained(Path(checkpoint_dir) / HF_DIR)
    dtype = getattr(torch, info["dtype"].removeprefix("torch."))
    start = time.perf_counter()
    initialize_megatron_parallel(layout)
    model = build_gpt_model(hf_config, layout, dtype)
    built = time.perf_counter()
    load_megatron_checkpoint(model, checkpoint_dir)
    seconds = {"build": built - start, "read": time.perf_counter() - built}
    return LoadedModel(model, hf_config, info["family"], dtype, seconds)


def convert_hf_to_megatron(hf_dir: str | Path, output: str | Path,
                           layout: MegatronParallel = MegatronParallel()) -> Conversion:
    """Write the HF checkpoint as a Megatron checkpoint laid out as `layout` (loadable at any layout)."""
    loaded = load_hf_as_megatron(hf_dir, layout)
    start = time.perf_counter()
    save_megatron_checkpoint(loaded.model, output, hf_dir, layout, loaded.family, loaded.dtype)
    return Conversion(Path(output), {**loaded.seconds, "write": time.perf_counter() - start})


def convert_megatron_to_hf(checkpoint_dir: str | Path, output: str | Path,
                           layout: MegatronParallel = MegatronParallel(),
                           max_shard_bytes: int = 2 * 1024**3) -> Conversion:
    """Write a Megatron checkpoint as an HF directory that `AutoModelForCausalLM.from_pretrained` loads."""
    loaded = load_megatron_as_megatron(checkpoint_dir, layout)
    start = time.perf_counter()
    export_hf_weights(loaded.model, loaded.hf_config, output, max_shard_bytes=max_shard_bytes)
    if not dist.is_initialized() or dist.get_rank() == 0:
        copy_hf_side_files(Path(checkpoint_dir) / HF_DIR, output)
    return Conversion(Path(output), {**loaded.seconds, "write": time.perf_counter() - start})
