"""Joining and leaving the process group that torchrun's workers share (gloo on CPU, nccl on GPU).

torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT; `init_distributed` reads them.
A one-process run never creates a group, unless a mesh is asked for explicitly (then a private
in-memory store serves the single rank, so nothing listens on a port).
"""
from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


def comm_device_type() -> str:
    """Where collectives run: 'cuda' with nccl, 'cpu' with gloo."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def init_distributed(world_size: int | None = None) -> bool:
    """Join the default process group once (no-op if joined); return whether one exists."""
    if dist.is_initialized():
        return True
    world_size = int(os.environ.get("WORLD_SIZE", "1")) if world_size is None else world_size
    backend = "nccl" if comm_device_type() == "cuda" else "gloo"
    if comm_device_type() == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if world_size > 1 and "MASTER_ADDR" not in os.environ:
        raise RuntimeError(f"WORLD_SIZE={world_size} but MASTER_ADDR is not set: start the workers with torchrun "
                           f"(python -m torch.distributed.run --nproc-per-node {world_size} ...), which sets both.")
    if world_size > 1 or "MASTER_ADDR" in os.environ:
        dist.init_process_group(backend=backend)
    else:
        dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1)
    if is_main_process():
        logger.info("joined process group: backend %s, %d processes", backend, dist.get_world_size())
    return True


def is_distributed() -> bool:
    return dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def is_main_process() -> bool:
    """Rank 0 (or the only process): the one that logs, reports and writes files."""
    return rank() == 0


def all_reduce_sum(values: list[float], group=None) -> list[float]:
    """Sum numbers over the group (float64: token counts stay exact); identity without a group."""
    if not is_distributed():
        return list(values)
    tensor = torch.tensor(values, dtype=torch.float64, device=comm_device_type())
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    return tensor.tolist()


def barrier() -> None:
    if is_distributed():
        dist.barrier()


def close_distributed() -> None:
    """Leave the process group (at the end of a worker; harmless when there is none).

    The ranks meet first: a rank that tears down its gloo connections while a peer is still using them
    (rank 0 writing results after the last collective, say) can abort the peer at exit
    ("terminate called without an active exception", seen about 1 run in 6 with several subgroups).
    Not after this rank failed (`abandon_exit_barrier`): the peers may be inside a collective this
    rank will never join, and waiting for them would hang the run instead of ending it with the error.
    """
    if dist.is_initialized():
        if not _exit_barrier_abandoned:
            dist.barrier()
        dist.destroy_process_group()


_exit_barrier_abandoned = False


def abandon_exit_barrier() -> None:
    """This rank failed: close_distributed leaves without meeting the others (see there)."""
    global _exit_barrier_abandoned
    _exit_barrier_abandoned = True
