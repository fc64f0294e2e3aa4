"""Resumable training state: what a crashed or cancelled run needs to continue exactly where it stopped.

Every `checkpoint_every` optimizer steps the recipe writes `checkpoint_dir/training_state/step-NNNNNNNN/`
(twinkle_core.models.state_dirs: checksums, the last `keep_checkpoints` kept, damaged ones skipped):

    state.pt       trainable weights (the LoRA adapter, or every weight in full fine-tuning), optimizer and
                   LR-scheduler state, the fp16 loss scaler, the optimizer step count, every rank's RNG state;
                   plain data only, read with `weights_only=True` (no pickled code runs on resume)
    progress.json  the step, the micro-batches of the seeded data order already consumed, and the settings
                   that must not change across a resume (a mismatch is refused, naming the setting)
    manifest.json  the sha256 of both, written last

When the run starts again with the same `checkpoint_dir` (a retried flow run uses the same run folder, and
so does the same command run again), `load_training_state` restores the newest intact state; the recipe
then skips the consumed micro-batches of the same seeded order, so the resumed steps see the same data,
learning rate and optimizer moments as an uninterrupted run: their losses are equal.

Several processes: `torch.distributed.checkpoint.state_dict.get_state_dict` gathers the full (unsharded)
model and optimizer state on rank 0, which writes one file; on resume every rank reads it and
`set_state_dict` keeps its own shard. The same file thus resumes one process or a sharded run (several
machines: `checkpoint_dir` must be on a filesystem they share, as for the final checkpoint).
"""
from __future__ import annotations

import json
import logging
import pickle
import random
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict, set_state_dict)

from twinkle_core.errors import UserError
from twinkle_core.models.state_dirs import (PROGRESS_FILE, STATE_DIR, finish_state, newest_intact_state,
                                            partial_dir, read_progress, remove_partial, saved_states, state_name,
                                            state_root)
from twinkle_core.parallel import is_main_process
from twinkle_core.parallel.process_group import barrier

logger = logging.getLogger(__name__)
STATE_FILE = "state.pt"
__all__ = ["STATE_DIR", "PROGRESS_FILE", "STATE_FILE", "ResumeMismatch", "check_resume_settings",
           "load_training_state", "read_progress", "save_training_state"]


class ResumeMismatch(UserError):
    """The saved state was written by a run with different settings."""


def _options() -> StateDictOptions:
    distributed = dist.is_available() and dist.is_initialized()
    # Frozen weights come from the model id, not the state: loading is checked against the trainable ones.
    return StateDictOptions(full_state_dict=distributed, cpu_offload=distributed, ignore_frozen_params=True,
                            strict=False)


def save_training_state(model: Any, checkpoint_dir: str | Path, progress: dict, keep: int = 2) -> Path:
    """Write a new state under `checkpoint_dir/training_state` for a TransformersModel (every rank calls it);
    keep the newest `keep`. A failed write (a full disk) leaves the earlier states as they were."""
    module, stepper = model.training_parts()
    weights, optimizer = get_state_dict(module, stepper.optimizer, options=_options())
    rng = _all_ranks(rng_state())  # each rank's own: their dropout masks differ
    partial = partial_dir(checkpoint_dir, stepper.step)
    saved = None
    if is_main_process():
        state = {"model": weights, "optimizer": optimizer, "step": stepper.step,
                 "scheduler": stepper.scheduler.state_dict() if stepper.scheduler else None,
                 "scaler": stepper.scaler.state_dict() if stepper.scaler else None, "rng": rng}
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        try:
            torch.save(state, partial / STATE_FILE)
            saved = finish_state(partial, {**progress, "step": stepper.step}, keep)
        except OSError as err:
            shutil.rmtree(partial, ignore_errors=True)
            kept = [s.name for s in saved_states(checkpoint_dir)]
            raise OSError(err.errno, f"saving the training state of step {stepper.step} failed ({err.strerror or err}); "
                                     f"the earlier states {kept or 'none'} in {state_root(checkpoint_dir)} are intact")
        logger.info("saved the training state at step %d to %s", stepper.step, saved)
    barrier()  # no rank trains on before the state exists
    return saved or state_root(checkpoint_dir) / state_name(stepper.step)


def check_resume_settings(progress: dict, settings: dict, where: Path) -> None:
    """Refuse to resume a state written with other settings, naming each one that changed."""
    changed = {k: (progress["settings"].get(k), v) for k, v in settings.items() if progress["settings"].get(k) != v}
    if changed:
        detail = ", ".join(f"{k}: saved {old!r}, now {new!r}" for k, (old, new) in changed.items())
        raise ResumeMismatch(f"{where} was written with other settings ({detail}); "
                             "resume with the same settings, or use a new checkpoint_dir to start over.")


def load_training_state(model: Any, checkpoint_dir: str | Path, settings: dict) -> dict | None:
    """Restore the newest intact training state into `model`; return its progress record (None: nothing to
    resume).

    `settings` are the values the state was written with (`progress["settings"]`); any difference is
    refused, since resuming under another data order, batch size or schedule is not a resume.
    """
    remove_partial(checkpoint_dir)
    state_dir = newest_intact_state(checkpoint_dir)
    if state_dir is None:
        return None
    progress = json.loads((state_dir / PROGRESS_FILE).read_text())
    check_resume_settings(progress, settings, state_dir)
    state = read_state_file(state_dir / STATE_FILE)
    module, stepper = model.training_parts()
    keys = set_state_dict(module, stepper.optimizer, model_state_dict=state["model"],
                          optim_state_dict=state["optimizer"], options=_options())
    trainable = {name for name, p in module.named_parameters() if p.requires_grad}
    missing = sorted(set(keys.missing_keys) & trainable)
    if missing or keys.unexpected_keys:
        raise ResumeMismatch(f"{state_dir} does not fit this model: missing {missing[:5]}, "
                             f"unexpected {list(keys.unexpected_keys)[:5]}; use a new checkpoint_dir to start over.")
    stepper.step = progress["step"]
    if stepper.scheduler is not None:
        stepper.scheduler.load_state_dict(state["scheduler"])
    if stepper.scaler is not None:
        stepper.scaler.load_state_dict(state["scaler"])
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    set_rng_state(state["rng"][rank if rank < len(state["rng"]) else 0])
    logger.info("resumed from the training state at step %d (%s)", progress["step"], state_dir)
    return progress


def read_state_file(path: Path) -> dict:
    """The saved state, read as plain data only (tensors, numbers, strings, containers): `weights_only=True`
    refuses any other pickled object without running it, so a writable run folder cannot run code here."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        raise ResumeMismatch(f"{path} holds more than tensors and plain data, so it is not loaded (it could run "
                             f"code): {str(err).splitlines()[0]}. Use a new checkpoint_dir to start over.") from None


def _all_ranks(value: Any) -> list:
    """`value` from every rank, in rank order (one process: [value])."""
    if not (dist.is_available() and dist.is_initialized()):
        return [value]
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def rng_state() -> dict:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
