"""What a model needs from a parallel strategy, the one-process strategy, and the choice between them.

A strategy wraps the loss module (`prepare`), runs backward, combines numbers across the data-parallel
ranks and clips gradients. Every data-parallel strategy gives the same update as one process on the
global batch:

- each rank back-propagates the *summed* token loss of its local share of the batch;
- DDP and FSDP average gradients over the N data-parallel ranks (a sum ÷ N);
- the stepper sums the step's trained tokens (and losses) over those ranks and multiplies the gradients
  by N / global_tokens, leaving Σ_rank ∇loss_sum / global_tokens: the gradient of the token-mean loss of
  the whole global batch, which is what one process computes.

With sequence parallelism the N ranks are dp × fsdp × sp (`DeviceMesh.token_parallel_*`): an sp rank holds
a slice of the same rows as its sp peers, i.e. different tokens, so it is one more rank to sum over
(twinkle_core.parallel.sequence). DDP then replicates over, and FSDP shards over, those ranks.

Choice: one process → SingleProcess; tp_size > 1 → TensorParallel (TP alone, or under fully_shard for
FSDP × TP, twinkle_core.parallel.tp); fsdp_size = 1 (dp and/or sp > 1) → DDP; fsdp_size > 1 → FSDP (HSDP
when dp_size > 1
too), managed by Accelerate (`strategy='accelerate'`, the default) or by `fully_shard` (`'native_fsdp'`).
ep_size > 1 wraps the DDP/FSDP choice in ExpertParallel (twinkle_core.parallel.expert): the experts are
sharded over ep groups and get their own gradient reduction; that strategy leaves them alone.
"""
from __future__ import annotations

import contextlib
import logging
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from twinkle_core.parallel.config import Strategy, check_implemented
from twinkle_core.parallel.mesh import DeviceMesh
from twinkle_core.parallel.process_group import all_reduce_sum, is_main_process

logger = logging.getLogger(__name__)
BuildOptimizer = Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]


def trainable(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in module.parameters() if p.requires_grad]


def norm_as_float(norm: torch.Tensor) -> float:
    """A gradient norm as a number (FSDP returns a replicated DTensor)."""
    full = getattr(norm, "full_tensor", None)
    return float(full() if callable(full) else norm)


class SingleProcess:
    """One process: the module is used as it is and nothing is combined across ranks.

    Also the base of the multi-process strategies: its methods are what a model and its Stepper call.
    """

    name = "single"
    is_distributed = False
    is_sharded = False
    data_parallel_size = 1
    data_parallel_rank = 0

    def prepare(self, module: torch.nn.Module, build_optimizer: BuildOptimizer):
        """Wrap `module` for training and build the optimizer over its trainable parameters."""
        return module, build_optimizer(trainable(module))

    def gradient_sync(self, module: torch.nn.Module, enabled: bool):
        """Context for one micro-batch; `enabled=False` may skip the gradient exchange (accumulation)."""
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def all_reduce_sum(self, values: list[float]) -> list[float]:
        return list(values)

    @property
    def grad_average_size(self) -> int:
        """How many ranks the wrapped module averages gradients over."""
        return self.data_parallel_size

    def clip_grad_norm_(self, parameters: list[torch.nn.Parameter], max_norm: float) -> float:
        return norm_as_float(torch.nn.utils.clip_grad_norm_(parameters, max_norm))

    def grad_scaler(self, device_type: str) -> torch.amp.GradScaler:
        return torch.amp.GradScaler(device_type)


class DataParallelStrategy(SingleProcess):
    """What every multi-process strategy shares: the mesh, the data-parallel group, the sums over it."""

    is_distributed = True

    def __init__(self, mesh: DeviceMesh, precision):
        self.mesh = mesh
        self.precision = precision
        self.group = mesh.token_parallel_group

    @property
    def data_parallel_size(self) -> int:
        return self.mesh.data_parallel_size

    @property
    def data_parallel_rank(self) -> int:
        return self.mesh.data_parallel_rank

    @property
    def grad_average_size(self) -> int:
        return self.mesh.token_parallel_size

    def all_reduce_sum(self, values: list[float]) -> list[float]:
        return all_reduce_sum(values, self.group)

    def grad_scaler(self, device_type: str) -> torch.amp.GradScaler:
        """fp16 under FSDP: each rank sees only its gradient shards, so all ranks must agree on an overflow."""
        if not self.is_sharded:
            return super().grad_scaler(device_type)
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(device=device_type)

    def shard_mesh(self):
        """The mesh FSDP shards over: 1-D `fsdp` (× `sp`), or 2-D (`dp` replicas × those shards) for HSDP."""
        shard = self.mesh.shard_dim
        return self.mesh["dp", shard] if self.mesh.size("dp") > 1 else self.mesh[shard]


def broadcast_trainable(module: torch.nn.Module) -> None:
    """Give every rank rank 0's trainable weights before sharding (LoRA starts random; HSDP replicas must agree).

    Tensor-parallel (DTensor) weights are skipped: they were cut from weights broadcast before tp sharding.
    Expert shards (expert parallelism) differ by rank on purpose and are left alone.
    """
    from twinkle_core.parallel.expert import expert_parameters

    own = {id(p) for p in expert_parameters(module)}
    for param in trainable(module):
        if not isinstance(param, DTensor) and id(param) not in own:
            dist.broadcast(param.data, src=0)


def build_strategy(strategy: Strategy, mesh: DeviceMesh | None, precision) -> SingleProcess:
    """The strategy for this mesh (None or one rank: SingleProcess)."""
    if mesh is None or mesh.size() == 1:
        return SingleProcess()
    sizes = mesh.sizes
    check_implemented(sizes)
    if sizes["tp_size"] > 1:  # TP, under fully_shard when dp/fsdp > 1 (check_implemented refuses TP with sp/ep)
        from twinkle_core.parallel.tp import TensorParallel

        chosen = TensorParallel(mesh, precision)
    elif sizes["fsdp_size"] == 1:
        from twinkle_core.parallel.ddp import DDPStrategy

        chosen = DDPStrategy(mesh, precision)
    elif strategy is Strategy.native_fsdp:
        from twinkle_core.parallel.fsdp import NativeFSDP

        chosen = NativeFSDP(mesh, precision)
    else:
        from twinkle_core.parallel.accelerate_fsdp import AccelerateFSDP

        chosen = AccelerateFSDP(mesh, precision)
    if sizes["ep_size"] > 1:  # experts sharded over ep groups, the rest trained by the strategy chosen above
        from twinkle_core.parallel.expert import ExpertParallel

        chosen = ExpertParallel(chosen)
    if is_main_process():
        logger.info("parallel strategy %s over %r (%s precision)", chosen.name, mesh, precision.mode.value)
    return chosen
