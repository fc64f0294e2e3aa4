"""Parallel settings of a run, validated before any process starts.

Data parallelism (DDP, FSDP via Accelerate or natively, HSDP) runs on one machine or several; tensor
parallelism alone or with FSDP/HSDP (FSDP × TP); sequence parallelism (sp_size, Ulysses) alongside
DDP/FSDP; expert parallelism (ep_size > 1, MoE models, over the data-parallel ranks). TP with SP or EP is
refused with a clear "not supported yet". `check_parallel_config` is the Transformers backend's layout rule
(twinkle_core.train.checks runs it before launch).

`sequence_parallel=True` (Transformers backend) is a shorthand: with sp_size left at 1, the sequences are
split over every rank that dp_size, fsdp_size and tp_size leave (all of them when only it is given).
"""
from __future__ import annotations

import os

from twinkle_core.config.fields import (DataParallelFields, MachinesFields, ModelParallelFields, ProcessFields,
                                        Strategy)


class ParallelConfig(ModelParallelFields, DataParallelFields, MachinesFields, ProcessFields):
    """How the model and data are split across processes (the fields are twinkle_core.config's groups)."""

    def mesh_sizes(self, world_size: int | None = None) -> dict[str, int]:
        """dp/fsdp/tp/ep/sp sizes for `world_size` processes (default: nproc_per_node × nnodes).

        fsdp_size left empty takes the ranks that dp, sp and tp leave, so `nproc_per_node=N` alone means
        FSDP over N processes and `dp_size=N` alone means DDP.
        """
        world_size = self.world_size() if world_size is None else world_size
        sp = self.sp_size
        if self.sequence_parallel and sp == 1:
            sp = max(1, world_size // (self.dp_size * (self.fsdp_size or 1) * self.tp_size))
        fsdp = self.fsdp_size or max(1, world_size // (self.dp_size * sp * self.tp_size))
        return dict(dp_size=self.dp_size, fsdp_size=fsdp, tp_size=self.tp_size, ep_size=self.ep_size, sp_size=sp)


def parse_strategy(value: str | Strategy) -> Strategy:
    try:
        return Strategy(value)
    except ValueError:
        choices = ", ".join(repr(s.value) for s in Strategy)
        raise ValueError(f"strategy={value!r} is not a strategy; choose one of {choices}.") from None


def check_implemented(sizes: dict[str, int], pp_size: int = 1, sequence_parallel: bool = False) -> None:
    """Reject layouts whose strategy is not built (TP with SP or EP; PP is Megatron's).

    Tensor parallelism alone or with dp/fsdp (FSDP × TP) is supported (twinkle_core.parallel.tp), sequence
    parallelism with DDP/FSDP (twinkle_core.parallel.sequence), and expert parallelism over DDP/FSDP
    (twinkle_core.parallel.expert).
    """
    from twinkle_core.parallel.expert import ep_unsupported
    from twinkle_core.parallel.sequence import sp_layout_problems
    from twinkle_core.parallel.tp import tp_unsupported

    problems = tp_unsupported(sizes) + sp_layout_problems(sizes) + ep_unsupported(sizes)
    if sequence_parallel and sizes.get("sp_size", 1) == 1:
        problems.append("sequence_parallel=True leaves no rank to split sequences over (sp_size=1: dp_size × "
                        "fsdp_size × tp_size already use every process); give sp_size > 1, leave fsdp_size "
                        "empty, or set sequence_parallel=False.")
    if pp_size != 1:
        problems.append(f"pp_size={pp_size}: pipeline parallelism arrives with the Megatron backend; "
                        "use pp_size=1 with the Transformers backend.")
    if problems:
        raise ValueError("unsupported parallel layout:\n  " + "\n  ".join(problems))


def check_parallel_config(parallel: ParallelConfig, model_config=None, world_size: int | None = None) -> dict[str, int]:
    """Everything about the layout that can be checked before launch; returns the resolved mesh sizes."""
    from twinkle_core.parallel.mesh import validate_mesh_sizes

    world_size = parallel.world_size() if world_size is None else world_size
    sizes = validate_mesh_sizes(parallel.mesh_sizes(world_size), world_size, model_config)
    check_implemented(sizes, parallel.pp_size, parallel.sequence_parallel)
    return sizes


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def worker_mesh(parallel: ParallelConfig):
    """The DeviceMesh `parallel` describes for the processes torchrun started (None for one process)."""
    from twinkle_core.parallel.mesh import DeviceMesh

    world_size = world_size_from_env()  # the layout was checked before launch (twinkle_core.train.checks)
    return DeviceMesh.from_sizes(**parallel.mesh_sizes(world_size)) if world_size > 1 else None
