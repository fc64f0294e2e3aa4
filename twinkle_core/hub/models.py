"""Resolve a model id to a local Hugging Face model directory and its content hash."""
from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from twinkle_core.hashing import hash_tree

from .archive import materialise_zip
from .errors import HubError
from .gguf import materialise_gguf
from .ids import parse_id
from .integrity import check_model_folder
from .internlm2 import is_internlm2, materialise_internlm2
from .internvl import is_internvl_chat, materialise_internvl
from .local import local_target
from .snapshots import download_snapshot, snapshot_hash


@dataclass(frozen=True)
class ResolvedModel:
    """A model ready to load with `from_pretrained(path)`."""

    model_id: str  # as the user gave it
    path: Path  # a Hugging Face model directory: config.json, weights, tokenizer
    content_hash: str  # sha256 hex identifying the content (cache key for later steps)


def resolve_model(model_id: str) -> ResolvedModel:
    """Resolve `ms://`, `hf://`, `pkg://`, `file://` ids or paths (a model directory, a .gguf file, or a .zip
    of a model directory, as the all-MiniLM-L6-v2 package ships one).

    An InternLM2 directory resolves to its Llama conversion in the cache (see internlm2.py), an original
    (remote-code) InternVL directory to its native `internvl` conversion (see internvl.py).
    """
    parsed = parse_id(model_id)
    if parsed.split:
        raise HubError(f"model id {model_id!r}: ':{parsed.split}' selects a dataset split; a model id takes none")
    if parsed.scheme in ("hf", "ms"):
        folder = download_snapshot(parsed, model_id, "model")
        _require_model_dir(folder, model_id)
        return _model_dir(model_id, folder, snapshot_hash(parsed, folder))
    target = local_target(parsed, model_id)
    if target.is_file():
        suffix = target.suffix.lower()
        if suffix not in (".gguf", ".zip"):
            raise HubError(f"model id {model_id!r}: {str(target)!r} is a file but not a .gguf or a .zip; "
                           "give a model directory")
        folder, digest = (materialise_gguf if suffix == ".gguf" else materialise_zip)(target)
        return ResolvedModel(model_id, folder, digest)
    _require_model_dir(target, model_id)
    # Local directories may be edited in place, so their hash covers every byte.
    return _model_dir(model_id, target, hash_tree(target))


def _model_dir(model_id: str, folder: Path, digest: str) -> ResolvedModel:
    # InternLM2 ships its own modelling code: a converted Llama copy is loaded instead of running it.
    if is_internlm2(folder):
        folder = materialise_internlm2(folder, digest)
    # So does OpenGVLab's InternVL (`internvl_chat`): a converted native `internvl` copy is loaded instead.
    elif is_internvl_chat(folder):
        folder = materialise_internvl(folder, digest)
    return ResolvedModel(model_id, folder, digest)


def _require_model_dir(folder: Path, model_id: str) -> None:
    if not (folder / "config.json").is_file():
        found = sorted(p.name for p in folder.iterdir())[:20]
        raise HubError(
            f"model id {model_id!r}: {str(folder)!r} is not a Hugging Face model directory (no config.json); "
            f"it holds {found} (for a GGUF model give the path of the .gguf file itself)"
        )


PICKLE_WEIGHTS = ("pytorch_model.bin", "pytorch_model.bin.index.json")


def check_weight_files(folder: str | Path, model_id: str, allow_pickle: bool = False) -> str | None:
    """How the model directory ships its weights: "safetensors", "pickle", or None (e.g. GGUF-converted
    folders always hold safetensors). Pickle-only weights can run code when loaded by an unsafe reader, so
    they are refused unless `allow_pickle` (they are then read with torch.load(weights_only=True))."""
    folder = Path(folder)
    if any(folder.glob("*.safetensors")) or (folder / "model.safetensors.index.json").is_file():
        check_model_folder(folder, model_id)  # whole files and a tokenizer, before anything loads them
        return "safetensors"
    if not any((folder / name).is_file() for name in PICKLE_WEIGHTS):
        if (folder / "config.json").is_file():  # a Hugging Face folder (not a Megatron checkpoint) without weights
            where = f"model id {model_id!r}" + ("" if str(folder) == model_id else f" ({folder})")
            raise HubError(f"{where} is damaged: it has config.json but no weight files (model.safetensors, or "
                           "model.safetensors.index.json with its shards). Download or copy it again.")
        return None
    if not allow_pickle:
        where = "" if str(folder) == model_id else f": {str(folder)!r}"
        raise HubError(f"model id {model_id!r}{where} ships its weights only as pickle files "
                       "(pytorch_model.bin), which this project does not load by default; convert them to "
                       "safetensors, or pass --allow-pickle-weights (allow_pickle_weights=True) to load them with "
                       "torch.load(weights_only=True).")
    return "pickle"


# A vision-language model's image/video processor settings: save_pretrained does not write them, so every
# checkpoint, merged model and export copies them from the folder it came from.
PROCESSOR_FILES = ("preprocessor_config.json", "video_preprocessor_config.json", "processor_config.json")


def copy_processor_files(source: str | Path, target: str | Path) -> None:
    for name in PROCESSOR_FILES:
        if (Path(source) / name).is_file():
            shutil.copy2(Path(source) / name, Path(target) / name)
