"""The training state of every tenant of a multi-LoRA model, so that a killed multi_lora run resumes.

    checkpoint_dir/training_state/step-NNNNNNNN/   rank-00000.pt (one per rank), progress.json, manifest.json

NNNNNNNN counts rounds (a round gives every unfinished tenant one micro-batch). A state is saved only
between optimizer steps of every tenant, so no accumulated gradient is lost. Each rank writes its own part
of every tenant's adapter weights and optimizer state, as it holds them (an FSDP or tensor-parallel shard),
with its RNG state; resuming therefore needs the same layout, which the settings check. Folders, checksums,
the fallback to an earlier intact state and `keep` are those of state_dirs, as for one adapter.
"""
from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from twinkle_core.models.state_dirs import (PROGRESS_FILE, finish_state, newest_intact_state, partial_dir,
                                            remove_partial, saved_states, state_name, state_root)
from twinkle_core.models.stepper import Stepper
from twinkle_core.models.training_state import (ResumeMismatch, check_resume_settings, read_state_file,
                                                rng_state, set_rng_state)
from twinkle_core.parallel import is_main_process
from twinkle_core.parallel.process_group import all_reduce_sum, barrier, rank

logger = logging.getLogger(__name__)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _params(stepper: Stepper) -> list[torch.nn.Parameter]:
    """The tenant's weights as its optimizer holds them (sharded ones under FSDP)."""
    return [p for group in stepper.optimizer.param_groups for p in group["params"]]


def _stepper_state(stepper: Stepper) -> dict:
    optimizer = stepper.optimizer.state_dict()
    optimizer["state"] = {key: {k: _local(v).detach().clone() if torch.is_tensor(v) else v for k, v in state.items()}
                          for key, state in optimizer["state"].items()}
    return {"weights": [_local(p).detach().clone() for p in _params(stepper)], "optimizer": optimizer,
            "step": stepper.step, "scheduler": stepper.scheduler.state_dict() if stepper.scheduler else None,
            "scaler": stepper.scaler.state_dict() if stepper.scaler else None}


def _restore_stepper(name: str, stepper: Stepper, state: dict, where: Path) -> None:
    params = _params(stepper)
    shapes = [tuple(_local(p).shape) for p in params]
    if shapes != [tuple(w.shape) for w in state["weights"]]:
        raise ResumeMismatch(f"{where}: tenant {name!r}'s saved adapter does not fit this one (other rank, "
                             "targets or layout); resume with the same settings, or use a new run folder.")
    with torch.no_grad():
        for param, saved in zip(params, state["weights"]):
            _local(param).copy_(saved)
    stepper.optimizer.load_state_dict(state["optimizer"])
    for param in params:  # a sharded weight's moments go back into the same sharded form
        if isinstance(param, DTensor):
            moments = stepper.optimizer.state.get(param, {})
            for key, value in moments.items():
                if torch.is_tensor(value) and not isinstance(value, DTensor) and value.shape == param.to_local().shape:
                    moments[key] = DTensor.from_local(value, param.device_mesh, param.placements, shape=param.shape,
                                                      stride=param.stride())
    stepper.step = state["step"]
    if stepper.scheduler is not None:
        stepper.scheduler.load_state_dict(state["scheduler"])
    if stepper.scaler is not None:
        stepper.scaler.load_state_dict(state["scaler"])


def _rank_file(state_dir: Path, index: int) -> Path:
    return state_dir / f"rank-{index:05d}.pt"


def save_tenant_states(steppers: dict[str, Stepper], checkpoint_dir: str | Path, progress: dict, keep: int) -> Path:
    """Write every tenant's state at round `progress["round"]` (every rank calls it); keep the newest `keep`.
    A failed write on any rank (a full disk) fails the save on every rank and leaves earlier states as they were."""
    round_ = progress["round"]
    partial = partial_dir(checkpoint_dir, round_)
    if is_main_process():
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    barrier()
    state = {"tenants": {name: _stepper_state(stepper) for name, stepper in steppers.items()}, "rng": rng_state()}
    error = None
    try:
        torch.save(state, _rank_file(partial, rank()))
    except OSError as err:
        error = err
    if all_reduce_sum([0.0 if error is None else 1.0])[0]:
        barrier()
        if is_main_process():
            shutil.rmtree(partial, ignore_errors=True)
        kept = [s.name for s in saved_states(checkpoint_dir)]
        raise OSError(getattr(error, "errno", None), f"saving the tenants' training state of round {round_} failed "
                      f"({error or 'on another rank'}); the earlier states {kept or 'none'} in "
                      f"{state_root(checkpoint_dir)} are intact")
    barrier()  # every rank's file is complete before the manifest hashes them
    final = state_root(checkpoint_dir) / state_name(round_)
    if is_main_process():
        final = finish_state(partial, progress, keep)
        logger.info("saved the tenants' training state at round %d to %s", round_, final)
    barrier()
    return final


def load_tenant_states(steppers: dict[str, Stepper], checkpoint_dir: str | Path, settings: dict) -> dict | None:
    """Restore every tenant from the newest intact state; its progress record (None: nothing to resume).
    The saved tenants and settings (layout, each tenant's hyper-parameters) must be those of this run."""
    if is_main_process():
        remove_partial(checkpoint_dir)
    barrier()
    state_dir = newest_intact_state(checkpoint_dir)
    if state_dir is None:
        return None
    progress = json.loads((state_dir / PROGRESS_FILE).read_text())
    check_resume_settings(progress, settings, state_dir)
    path = _rank_file(state_dir, rank())
    if not path.is_file():
        raise ResumeMismatch(f"{state_dir} has no state for rank {rank()}: it was saved by another number of "
                             "processes; resume with the same layout.")
    state = read_state_file(path)
    if sorted(state["tenants"]) != sorted(steppers):
        raise ResumeMismatch(f"{state_dir} holds tenants {sorted(state['tenants'])}, this run trains "
                             f"{sorted(steppers)}; resume with the same tenants, or use a new run folder.")
    for name, stepper in steppers.items():
        _restore_stepper(name, stepper, state["tenants"][name], state_dir)
    set_rng_state(state["rng"])
    logger.info("resumed every tenant from round %d (%s)", progress["round"], state_dir)
    return progress

