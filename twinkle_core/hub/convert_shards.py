"""Rewrite a checkpoint's safetensors, shard by shard, into another architecture's tensor names.

The on-download conversions of remote-code checkpoints (InternLM2 -> Llama, OpenGVLab InternVL -> transformers'
native `internvl`) share this: every converted tensor must have a place and the shape the target model with
the converted config expects, each shard is written as soon as it is read (peak memory stays near one source
shard), and nothing the target needs may be missing.
"""
from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

from twinkle_core.atomic import atomic_dir
from twinkle_core.hub.errors import HubError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Conversion:
    """How the errors of one conversion name things."""

    source: str  # "InternLM2 checkpoint"
    target: str  # "a Llama model"
    unplaced_hint: str  # what to check when a tensor has no place in the target
    missing_hint: str  # what the missing names are, and the likely cause

    def error(self, src: Path, message: str) -> HubError:
        return HubError(f"{self.source} {str(src)!r}: {message}")


def converted_once(src: Path, final: Path, conversion: Conversion, layout: str,
                   convert: Callable[[Path, Path], None]) -> Path:
    """`final`, written by `convert(src, tmp)` on first use only (atomic_dir renames the folder into place only
    when complete, so its config.json means "done")."""
    if (final / "config.json").is_file():
        log.debug("reusing converted %s %s at %s", conversion.source, src, final)
        return final
    log.info("converting %s %s to %s (once) into %s; no remote code is executed", conversion.source, src, layout, final)
    start = time.perf_counter()
    with atomic_dir(final) as tmp:
        convert(src, tmp)
    log.info("converted %s %s in %.1fs", conversion.source, src, time.perf_counter() - start)
    return final


def source_shards(src: Path, conversion: Conversion) -> list[str]:
    """The checkpoint's safetensors files, from its index when it has one."""
    index = src / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text()).get("weight_map", {}).values()))
        absent = [shard for shard in shards if not (src / shard).is_file()]
        if absent or not shards:
            raise conversion.error(src, f"model.safetensors.index.json lists missing shards {absent}; download the "
                                        "checkpoint again")
        return shards
    shards = sorted(path.name for path in src.glob("*.safetensors"))
    if not shards:
        found = sorted(path.name for path in src.iterdir())[:20]
        raise conversion.error(src, f"no *.safetensors weights (found {found}); converting reads safetensors only: "
                                    "download the safetensors files of the checkpoint")
    return shards


def expected_shapes(model_class, config) -> dict[str, tuple[int, ...]]:
    """Every tensor `model_class(config)` loads, and its shape (built on the meta device: no memory)."""
    import torch

    with torch.device("meta"):
        model = model_class(config)
    shapes = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
    if getattr(config, "tie_word_embeddings", False):
        shapes.pop("lm_head.weight", None)
    return shapes


def write_converted(src: Path, dst: Path, model_class, config,
                    convert: Callable[[str, object], Iterable[tuple[str, object]]], conversion: Conversion) -> None:
    """Write `convert(name, tensor)` of every source tensor to `dst` as safetensors (sharded as the source)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    expected = expected_shapes(model_class, config)
    shards = source_shards(src, conversion)
    outputs = ["model.safetensors"] if len(shards) == 1 else [
        f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)
    ]
    weight_map: dict[str, str] = {}
    total_size = 0
    for shard, output in zip(shards, outputs):
        tensors = {}
        with safe_open(src / shard, framework="pt") as handle:
            for name in handle.keys():
                for new_name, tensor in convert(name, handle.get_tensor(name)):
                    if new_name == "lm_head.weight" and getattr(config, "tie_word_embeddings", False):
                        continue  # tied: the head is read from the embeddings
                    _check(new_name, name, tensor, expected, weight_map, src, conversion)
                    tensors[new_name] = tensor
                    weight_map[new_name] = output
        save_file(tensors, dst / output, metadata={"format": "pt"})
        total_size += sum(tensor.numel() * tensor.element_size() for tensor in tensors.values())
        del tensors
    missing = sorted(set(expected) - set(weight_map))
    if missing:
        raise conversion.error(src, f"{len(missing)} tensors are missing, e.g. {missing[:4]} ({conversion.missing_hint})")
    if len(outputs) > 1:
        index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
        (dst / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _check(new_name: str, name: str, tensor, expected: dict, seen: dict, src: Path, conversion: Conversion) -> None:
    if new_name not in expected:
        raise conversion.error(src, f"tensor {name!r} (as {new_name!r}) has no place in {conversion.target} with "
                                    f"this config ({conversion.unplaced_hint})")
    if new_name in seen:
        raise conversion.error(src, f"tensor {name!r} appears in more than one shard")
    if tuple(tensor.shape) != expected[new_name]:
        raise conversion.error(src, f"tensor {name!r} has shape {tuple(tensor.shape)}, but config.json implies "
                                    f"{expected[new_name]} for {new_name!r}; config.json does not match the weights")
