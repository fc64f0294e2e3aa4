"""Save and load what TransformersModel trains: a PEFT adapter directory or a full checkpoint.

Both are written under a temporary name and renamed when complete. A model sharded or replicated over
several processes is saved in the same single-process format: `gather_full_state_dict` collects the
unsharded weights on rank 0 (all ranks take part), and rank 0 writes them with `save_checkpoint`.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from peft import PeftModel
from safetensors.torch import load_file

from twinkle_core.atomic import atomic_dir
from twinkle_core.hub import copy_processor_files

logger = logging.getLogger(__name__)
ADAPTER_CONFIG = "adapter_config.json"


def gather_full_state_dict(model: torch.nn.Module, trainable_only: bool) -> dict[str, torch.Tensor]:
    """Unsharded CPU copies of the weights on rank 0 (an empty dict elsewhere); every rank must call it.

    `trainable_only` (adapters): the frozen base weights are neither gathered nor written. A parameter
    shared by two modules (tied embeddings) is kept under its first name only, as one process saves it.
    Expert shards (expert parallelism) are all-gathered over their ep group and written whole.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from twinkle_core.parallel.expert import gather_expert_weights

    options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=trainable_only)
    state = get_model_state_dict(model, options=options)
    experts = gather_expert_weights(model, trainable_only)
    if state:  # rank 0 (the others get an empty state)
        state.update(experts)
    params = dict(model.named_parameters())
    aliases = {name for name, _ in model.named_parameters(remove_duplicate=False)} - set(params)
    keep = {name for name, p in params.items() if p.requires_grad} if trainable_only else None
    return {k: v for k, v in state.items() if k not in aliases and (keep is None or k in keep)}


def save_checkpoint(model: torch.nn.Module, tokenizer: Any, target: Path, adapter_name: str | None,
                    state_dict: dict[str, torch.Tensor] | None = None, source: Path | None = None) -> Path:
    """Write `target`; `state_dict` (from gather_full_state_dict) replaces the model's own weights. A full
    checkpoint takes the processor files of `source` (the loaded checkpoint), so it encodes media as that did."""
    with atomic_dir(target) as tmp:
        if adapter_name is not None:
            # A plain PEFT directory (adapter_config.json + adapter_model.safetensors) for this adapter.
            model.save_pretrained(tmp, selected_adapters=[adapter_name], state_dict=state_dict)
            nested = tmp / adapter_name
            if nested.is_dir():  # PEFT nests non-default adapter names; keep one flat directory
                for item in nested.iterdir():
                    item.rename(tmp / item.name)
                nested.rmdir()
        else:
            model.save_pretrained(tmp, safe_serialization=True, state_dict=state_dict)
            if source is not None:
                copy_processor_files(source, tmp)
        tokenizer.save_pretrained(tmp)
    logger.info("saved %s to %s", "adapter " + adapter_name if adapter_name else "full model", target)
    return target


def load_checkpoint(
    model: torch.nn.Module, source: Path, name: str, adapter_name: str | None
) -> tuple[torch.nn.Module, str | None]:
    """Load `source` into `model`; return the (possibly PEFT-wrapped) model and the adapter name if any."""
    if not source.is_dir():
        raise FileNotFoundError(f"checkpoint {source} does not exist; save(name, output_dir) writes output_dir/name.")
    if (source / ADAPTER_CONFIG).exists():
        if isinstance(model, PeftModel):
            model.load_adapter(source, adapter_name=name, is_trainable=True)
            model.set_adapter(name)
        else:
            model = PeftModel.from_pretrained(model, source, adapter_name=name, is_trainable=True)
        return model, name
    if adapter_name is not None:
        raise ValueError(f"{source} is a full checkpoint but this model has adapter {adapter_name!r}; "
                         "load it into a model without an adapter.")
    state: dict[str, torch.Tensor] = {}
    for file in sorted(source.glob("*.safetensors")):
        state.update(load_file(file))
    if not state:
        raise FileNotFoundError(f"{source} has neither {ADAPTER_CONFIG} nor *.safetensors weights.")
    missing, unexpected = model.load_state_dict(state, strict=False)
    # Tied output weights are saved once; anything else missing is a real mismatch.
    missing = [k for k in missing if k not in _tied_keys(model)]
    if missing or unexpected:
        raise ValueError(f"{source} does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}.")
    return model, None


def _tied_keys(model: torch.nn.Module) -> set[str]:
    tied = getattr(model, "_tied_weights_keys", None) or {}
    return set(tied if isinstance(tied, (list, set)) else tied.keys())
