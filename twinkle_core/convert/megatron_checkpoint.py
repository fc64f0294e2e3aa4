"""Megatron checkpoints on disk: a megatron-core distributed checkpoint plus what turns it back into HF.

Layout of a checkpoint directory:

    megatron/              `megatron.core.dist_checkpointing` (torch_dist): sharded tensors with their
                           global shapes and offsets, so any tp/pp layout can load them (resharding)
    hf/                    the HF config.json, generation_config.json and tokenizer files of the source
    twinkle_megatron.json  the layout it was written at, its family and dtype (for people and checks)

All ranks call `save_megatron_checkpoint` / `load_megatron_checkpoint` together. dist_checkpointing starts
a helper process: the program's entry module needs an `if __name__ == "__main__":` guard.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from twinkle_core.megatron.parallel_state import MegatronParallel

MEGATRON_DIR, HF_DIR, INFO_FILE = "megatron", "hf", "twinkle_megatron.json"
# Everything of an HF checkpoint directory except its weights.
_HF_SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                  "special_tokens_map.json", "tokenizer.model", "vocab.json", "merges.txt", "chat_template.jinja",
                  "added_tokens.json")


def is_megatron_checkpoint(path: str | Path) -> bool:
    return (Path(path) / INFO_FILE).is_file()


def copy_hf_side_files(src: str | Path, dst: str | Path) -> None:
    """Config, generation config and tokenizer of an HF directory (whatever of them it has)."""
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    for name in _HF_SIDE_FILES:
        if (Path(src) / name).is_file():
            shutil.copy2(Path(src) / name, dst / name)


def _is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def save_megatron_checkpoint(model, directory: str | Path, hf_source: str | Path, layout: MegatronParallel,
                             family: str, dtype: torch.dtype) -> Path:
    """Write `model` (this rank's part) as a dist checkpoint, with the HF side files of `hf_source`."""
    from megatron.core import dist_checkpointing

    directory = Path(directory)
    if _is_rank0():
        (directory / MEGATRON_DIR).mkdir(parents=True, exist_ok=True)
        copy_hf_side_files(hf_source, directory / HF_DIR)
    if dist.is_initialized():
        dist.barrier()
    dist_checkpointing.save(sharded_state_dict(model), str(directory / MEGATRON_DIR))
    if _is_rank0():
        info = {"format": "megatron-core dist_checkpointing (torch_dist)", "family": family,
                "saved_at": {"tp": layout.tp, "pp": layout.pp, "ep": layout.ep}, "dtype": str(dtype)}
        (directory / INFO_FILE).write_text(json.dumps(info, indent=2) + "\n")
    if dist.is_initialized():
        dist.barrier()
    return directory


def read_checkpoint_info(directory: str | Path) -> dict:
    path = Path(directory) / INFO_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{directory} is not a Megatron checkpoint written by this project "
                                f"(no {INFO_FILE}); convert an HF model with `--to megatron` first.")
    return json.loads(path.read_text())


def load_megatron_checkpoint(model, directory: str | Path) -> None:
    """Fill this rank's part of `model` from the dist checkpoint, whatever layout it was saved at."""
    from megatron.core import dist_checkpointing

    read_checkpoint_info(directory)
    state = dist_checkpointing.load(sharded_state_dict(model), str(Path(directory) / MEGATRON_DIR))
    chunks = model if isinstance(model, (list, tuple)) else [model]
    for index, chunk in enumerate(chunks):
        chunk.load_state_dict(state[f"model{index}"] if len(chunks) > 1 else state)


def sharded_state_dict(model) -> dict:
    """A model's dist-checkpoint entries; model chunks (virtual pipeline stages) nest under model0, model1...

    The entries carry global names and layer offsets, so any layout (with or without chunks) loads them.
    """
    if not isinstance(model, (list, tuple)):
        return model.sharded_state_dict()
    if len(model) == 1:
        return model[0].sharded_state_dict()
    return {f"model{index}": chunk.sharded_state_dict() for index, chunk in enumerate(model)}
