"""Conversions run as separate processes and cached by content hash, as downloads are.

A conversion is a pure function of its source's content and its settings, so its cache key is
`hash_json({source hash, direction, tp, pp, bridge version})` and its result lives under
`<cache>/conversions/<direction>-<family>-tp<N>pp<N>-<key>`. The directory is written under a temporary name
and renamed when complete, so a present directory is a finished conversion and is reused as is.

The conversion itself runs as `python -m twinkle_core.convert` (one process) or under torchrun with
tp × pp processes, which keeps megatron's process groups and the CPU device mode out of the caller's
process (the Prefect flow). Everything that can be checked is checked first, before any process starts.
"""
from __future__ import annotations

import logging
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Literal

from transformers import AutoConfig

from twinkle_core.atomic import atomic_dir
from twinkle_core.convert.conversion import megatron_family
from twinkle_core.convert.megatron_checkpoint import HF_DIR, INFO_FILE, read_checkpoint_info
from twinkle_core.hashing import hash_json, hash_tree
from twinkle_core.launch import cpu_threads_env, run_streaming, torchrun_command
from twinkle_core.megatron.model_builder import architecture_for, check_layout
from twinkle_core.megatron.parallel_state import MegatronParallel
from twinkle_core.paths import cache_dir

logger = logging.getLogger(__name__)

BRIDGE_VERSION = 1  # part of every cache key: bump when the bridge writes different bytes
Direction = Literal["megatron", "hf"]


@dataclass(frozen=True)
class Converted:
    path: Path
    content_hash: str
    family: str


def megatron_checkpoint_hash(directory: str | Path) -> str:
    """The content hash of a Megatron checkpoint directory (its files, not where it lies)."""
    return hash_tree(directory)


def check_conversion(source: str | Path, to: Direction, layout: MegatronParallel) -> str:
    """Everything checkable before a process starts; the source's family."""
    if to == "megatron":
        family = megatron_family(source)
        config_dir = Path(source)
    elif to == "hf":
        family = read_checkpoint_info(source)["family"]
        config_dir = Path(source) / HF_DIR
    else:
        raise ValueError(f"to={to!r}: choose 'megatron' (HF → Megatron) or 'hf' (Megatron → HF).")
    hf_config = AutoConfig.from_pretrained(config_dir)
    architecture_for(hf_config)
    check_layout(hf_config, layout)
    return family


def conversion_command(source: str | Path, output: str | Path, to: Direction, layout: MegatronParallel) -> list[str]:
    args = ["--to", to, "--source", str(source), "--output", str(output), "--tp", str(layout.tp),
            "--pp", str(layout.pp)]
    nproc = layout.tp * layout.pp
    if nproc == 1:
        return [sys.executable, "-m", "twinkle_core.convert", *args]
    return torchrun_command("twinkle_core.convert", args, nproc_per_node=nproc)


def convert_cached(source: str | Path, source_hash: str, to: Direction, layout: MegatronParallel = MegatronParallel(),
                   on_line: Callable[[str], None] = logger.info, timeout_s: float | None = None) -> Converted:
    """The conversion of `source` (content `source_hash`), from the cache or made now in worker processes."""
    family = check_conversion(source, to, layout)
    key = hash_json({"source": source_hash, "to": to, "tp": layout.tp, "pp": layout.pp, "bridge": BRIDGE_VERSION})
    final = cache_dir("conversions") / f"{to}-{family}-tp{layout.tp}pp{layout.pp}-{key[:16]}"
    done_marker = INFO_FILE if to == "megatron" else "config.json"
    if (final / done_marker).is_file():
        logger.info("reusing the conversion of %s at %s", source, final)
        return Converted(final, key, family)
    with atomic_dir(final) as tmp:
        run_streaming(conversion_command(source, tmp, to, layout), on_line, timeout_s=timeout_s,
                      env=cpu_threads_env(layout.tp * layout.pp))
    return Converted(final, key, family)


def copy_to(result: Path, output: str | Path) -> Path:
    """A copy of a cached conversion at `output` (a copy: editing it must not change the cache)."""
    output = Path(output)
    if output.exists() and any(output.iterdir()):
        raise FileExistsError(f"output={str(output)!r} exists and is not empty; choose a new folder.")
    shutil.copytree(result, output, dirs_exist_ok=True)
    return output
