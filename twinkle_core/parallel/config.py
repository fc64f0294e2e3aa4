"""Parallel settings of a run, validated before any process starts.

This release trains in one process; the settings and their names are the ones the distributed
strategies use, so configs written today keep working when they arrive.
"""
from __future__ import annotations

import os
from enum import Enum

from pydantic import BaseModel, Field


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
    dp_size: int = Field(1, ge=1, description="Data-parallel replicas.")
    tp_size: int = Field(1, ge=1, description="Tensor-parallel size.")
    pp_size: int = Field(1, ge=1, description="Pipeline-parallel size (Megatron backend).")
    ep_size: int = Field(1, ge=1, description="Expert-parallel size (MoE families).")
    sequence_parallel: bool = Field(False, description="Split long sequences across the tensor/sequence group.")

    def world_size(self) -> int:
        return self.nproc_per_node


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def check_single_process(parallel: ParallelConfig, world_size: int | None = None) -> None:
    """Reject settings that need several processes: this release trains in one."""
    world_size = world_size_from_env() if world_size is None else world_size
    wanted = {
        name: getattr(parallel, name)
        for name in ("nproc_per_node", "dp_size", "tp_size", "pp_size", "ep_size")
        if getattr(parallel, name) != 1
    }
    if parallel.sequence_parallel:
        wanted["sequence_parallel"] = True
    if world_size != 1:
        wanted["WORLD_SIZE"] = world_size
    if wanted:
        settings = ", ".join(f"{k}={v}" for k, v in wanted.items())
        raise ValueError(
            f"{settings}: distributed training is not supported by the Transformers backend in this release; "
            "it trains in one process. Set nproc_per_node=1, dp_size=tp_size=pp_size=ep_size=1 and "
            "sequence_parallel=False."
        )
