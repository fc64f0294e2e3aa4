"""Parallel settings of a run, validated before any process starts.

Data parallelism (DDP, FSDP via Accelerate or natively, HSDP) runs on one machine or several; tensor
parallelism alone or with FSDP/HSDP (FSDP × TP); sequence parallelism (sp_size, Ulysses) alongside
DDP/FSDP; expert parallelism (ep_size > 1, MoE models, over the data-parallel ranks). TP with SP or EP is
refused with a clear "not supported yet". `check_parallel_config` is what the flow calls.

`sequence_parallel=True` (Transformers backend) is a shorthand: with sp_size left at 1, the sequences are
split over every rank that dp_size, fsdp_size and tp_size leave (all of them when only it is given).
"""
from __future__ import annotations

import os
from enum import Enum

from pydantic import BaseModel, Field, model_validator


class Strategy(str, Enum):
    accelerate = "accelerate"  # FSDP managed by Accelerate (the default)
    native_fsdp = "native_fsdp"  # torch.distributed.fsdp.fully_shard


def parse_strategy(value: str | Strategy) -> Strategy:
    try:
        return Strategy(value)
    except ValueError:
        choices = ", ".join(repr(s.value) for s in Strategy)
        raise ValueError(f"strategy={value!r} is not a strategy; choose one of {choices}.") from None


class ParallelConfig(BaseModel):
    """How the model and data are split across processes."""

    strategy: Strategy = Field(Strategy.accelerate, description="FSDP manager: 'accelerate' or 'native_fsdp' (with tp_size > 1 always native).")
    nproc_per_node: int = Field(1, ge=1, description="Worker processes on this machine (torchrun).")
    dp_size: int = Field(1, ge=1, description="Data-parallel replicas: DDP when fsdp_size is 1, else the replicas of HSDP.")
    fsdp_size: int | None = Field(None, ge=1, description="Ranks one model is sharded over (FSDP); empty: all ranks left after dp, sp and tp.")
    sp_size: int = Field(1, ge=1, description="Sequence-parallel size: ranks one sequence is split over (Ulysses).")
    tp_size: int = Field(1, ge=1, description="Tensor-parallel size (with fsdp/dp sizes > 1: FSDP × TP, sharded by fully_shard).")
    pp_size: int = Field(1, ge=1, description="Pipeline-parallel size (Megatron backend).")
    ep_size: int = Field(1, ge=1, description="Expert-parallel size (MoE families).")
    sequence_parallel: bool = Field(False, description="Split sequences over the ranks that dp, fsdp and tp leave (sets sp_size when it is 1).")
    # several machines: one torchrun agent per machine, meeting at a c10d rendezvous
    nnodes: int = Field(1, ge=1, description="Machines in the run; each runs one torchrun agent with nproc_per_node workers.")
    node_rank: int = Field(0, ge=0, description="This machine's index, 0 .. nnodes-1, different on each machine.")
    rdzv_endpoint: str | None = Field(None, description="HOST:PORT of the c10d rendezvous on one of the machines (node 0 by convention), the same on every machine.")
    rdzv_id: str = Field("twinkle", min_length=1, description="Rendezvous id: the same on every machine of one run, new for each run.")
    max_restarts: int = Field(0, ge=0, description="Times torchrun restarts all workers after a worker fails.")

    @model_validator(mode="after")
    def _check_launch(self) -> "ParallelConfig":
        check_launch(self.nnodes, self.node_rank, self.rdzv_endpoint)
        return self

    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes

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


def check_launch(nnodes: int, node_rank: int, rdzv_endpoint: str | None) -> None:
    """Catch a wrong multi-machine setting here, not as a rendezvous that waits until it times out."""
    if node_rank >= nnodes:
        raise ValueError(f"node_rank={node_rank} is not below nnodes={nnodes}; give each machine its own "
                         f"node_rank from 0 to {nnodes - 1}, or raise nnodes.")
    if nnodes > 1 and not rdzv_endpoint:
        raise ValueError(f"nnodes={nnodes} needs rdzv_endpoint: set it to HOST:PORT of node 0 (e.g. "
                         "10.0.0.1:29500), the same on every machine.")
    if rdzv_endpoint:
        host, _, port = rdzv_endpoint.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"rdzv_endpoint={rdzv_endpoint!r} is not HOST:PORT; give node 0's address and a free "
                             "port, e.g. 10.0.0.1:29500.")


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

    world_size = world_size_from_env()
    sizes = parallel.mesh_sizes(world_size)
    check_implemented(sizes, parallel.pp_size, parallel.sequence_parallel)
    return DeviceMesh.from_sizes(**sizes) if world_size > 1 else None
