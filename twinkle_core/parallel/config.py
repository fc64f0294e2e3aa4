"""Parallel settings of a run, validated before any process starts.

Data parallelism (DDP, FSDP via Accelerate or natively, HSDP) runs on one machine or several, and pure
tensor parallelism (tp_size = world size); sp_size, ep_size, sequence_parallel and TP combined with other
dims are validated against the model already, and fail with a clear "arrives in" message until their
strategies exist. `check_parallel_config` is what the flow calls.
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

    strategy: Strategy = Field(Strategy.accelerate, description="FSDP manager: 'accelerate' or 'native_fsdp'.")
    nproc_per_node: int = Field(1, ge=1, description="Worker processes on this machine (torchrun).")
    dp_size: int = Field(1, ge=1, description="Data-parallel replicas: DDP when fsdp_size is 1, else the replicas of HSDP.")
    fsdp_size: int | None = Field(None, ge=1, description="Ranks one model is sharded over (FSDP); empty: all ranks left after dp, sp and tp.")
    sp_size: int = Field(1, ge=1, description="Sequence-parallel size: ranks one sequence is split over (Ulysses).")
    tp_size: int = Field(1, ge=1, description="Tensor-parallel size.")
    pp_size: int = Field(1, ge=1, description="Pipeline-parallel size (Megatron backend).")
    ep_size: int = Field(1, ge=1, description="Expert-parallel size (MoE families).")
    sequence_parallel: bool = Field(False, description="Split long sequences across the tensor/sequence group.")
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
        fsdp = self.fsdp_size or max(1, world_size // (self.dp_size * self.sp_size * self.tp_size))
        return dict(dp_size=self.dp_size, fsdp_size=fsdp, tp_size=self.tp_size, ep_size=self.ep_size,
                    sp_size=self.sp_size)


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


_ARRIVES_LATER = {
    "tp_size": "tensor parallelism",
    "sp_size": "sequence parallelism",
    "ep_size": "expert parallelism",
    "sequence_parallel": "sequence parallelism",
}


def check_implemented(sizes: dict[str, int], pp_size: int = 1, sequence_parallel: bool = False) -> None:
    """Reject layouts whose strategy is not built yet (SP, EP, TP combined with others; PP is Megatron's).

    Pure tensor parallelism (tp_size = world size, every other size 1) is supported (twinkle_core.parallel.tp).
    """
    from twinkle_core.parallel.tp import tp_unsupported

    wanted = {name: value for name, value in sizes.items() if name in _ARRIVES_LATER and value != 1}
    tp_problems = tp_unsupported(sizes)
    wanted.pop("tp_size", None)  # pure TP runs; TP with anything else is reported by tp_unsupported
    if sequence_parallel:
        wanted["sequence_parallel"] = True
    problems = [f"{name}={value}: {_ARRIVES_LATER[name]} for the Transformers backend arrives in a later release "
                f"(issue 4, TP/SP/EP part); use {name}={'False' if name == 'sequence_parallel' else 1}."
                for name, value in wanted.items()] + tp_problems
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

