"""megatron-core's process groups (tensor / pipeline / expert parallel) over the job's default group.

The default group is joined as everywhere else in the project (`twinkle_core.parallel.init_distributed`:
gloo on CPU, nccl on GPU, a private in-memory store for one process), then megatron's `parallel_state`
carves its groups out of it and seeds the tensor-parallel RNG tracker. On a machine without CUDA this also
switches on the CPU device mode, which megatron's group and RNG setup already need.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from twinkle_core.megatron.cpu_device import enable_cpu_device_mode
from twinkle_core.parallel.process_group import init_distributed


@dataclass(frozen=True)
class MegatronParallel:
    """The megatron layout: tp × cp × pp (× dp, implied) ranks; experts split ep-ways across the dp × tp ranks.

    Context parallelism (`cp`) splits each sequence over cp ranks inside Transformer Engine's attention (the
    rest of the layer is per token); those ranks hold the same weights and see the same rows, so megatron
    reduces gradients over data parallel × cp.

    The routed experts have their own tensor-parallel size, `etp` (None: megatron's default, tp): each
    expert's linears are split etp-ways, and the etp × ep × pp ranks that hold one copy of all experts are
    repeated world_size / (etp × ep × pp) times (expert data parallelism).
    """

    tp: int = 1
    pp: int = 1
    ep: int = 1
    sequence_parallel: bool = False  # split the activations outside attention/MLP along the sequence (needs tp)
    vpp: int | None = None  # virtual stages per pipeline rank: interleaved 1F1B over vpp model chunks (needs pp)
    etp: int | None = None  # expert-tensor-parallel size: routed experts' linears split etp-ways (None: tp)
    cp: int = 1  # context-parallel size: each sequence split over cp ranks (Transformer Engine's attention)

    @property
    def expert_tp(self) -> int:
        """The experts' tensor-parallel size megatron uses."""
        return self.tp if self.etp is None else self.etp

    def check(self, world_size: int) -> None:
        for name, size in (("tp", self.tp), ("pp", self.pp), ("ep", self.ep), ("cp", self.cp)):
            if not isinstance(size, int) or size < 1:
                raise ValueError(f"{name}={size!r}: parallel sizes must be integers >= 1.")
        if self.etp is not None and (not isinstance(self.etp, int) or self.etp < 1):
            raise ValueError(f"etp={self.etp!r}: the expert-tensor-parallel size is an integer >= 1, or empty for "
                             f"megatron's default (tp={self.tp}).")
        if self.vpp is not None and (not isinstance(self.vpp, int) or self.vpp < 2 or self.pp == 1):
            raise ValueError(f"vpp={self.vpp!r}: virtual pipeline stages interleave 2 or more model chunks per "
                             "pipeline rank and need pp > 1; use vpp >= 2 with pp_size >= 2, or leave it empty.")
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("sequence_parallel=True splits the sequence over the tensor-parallel ranks and needs "
                             "tp > 1; set tp_size=2 or more, or sequence_parallel=False.")
        model_parallel = self.tp * self.cp * self.pp
        if world_size % model_parallel:
            cp = f" x cp={self.cp}" if self.cp > 1 else ""
            raise ValueError(f"tp={self.tp}{cp} x pp={self.pp} does not divide the {world_size} processes; start "
                             f"a multiple of {model_parallel} processes (torchrun --nproc-per-node).")
        if (world_size // self.pp) % (self.ep * self.expert_tp):
            etp = f"etp={self.etp}" if self.etp is not None else f"etp={self.expert_tp} (tp's, by default)"
            raise ValueError(f"ep={self.ep} x {etp} does not divide the {world_size // self.pp} ranks of a "
                             f"pipeline stage: each copy of the experts spans ep x etp ranks; use ep and etp "
                             f"whose product divides world_size / pp (etp=1 keeps every expert whole).")


def initialize_megatron_parallel(layout: MegatronParallel, seed: int = 0) -> None:
    """Join the default group (if needed) and build megatron's groups for `layout`; idempotent per layout."""
    from megatron.core import parallel_state, tensor_parallel

    enable_cpu_device_mode()
    init_distributed()
    layout.check(dist.get_world_size())
    if parallel_state.model_parallel_is_initialized():
        current = (parallel_state.get_tensor_model_parallel_world_size(),
                   parallel_state.get_pipeline_model_parallel_world_size(),
                   parallel_state.get_expert_model_parallel_world_size(),
                   parallel_state.get_expert_tensor_parallel_world_size(),
                   parallel_state.get_context_parallel_world_size())
        if current == (layout.tp, layout.pp, layout.ep, layout.expert_tp, layout.cp) and \
                parallel_state.get_virtual_pipeline_model_parallel_world_size() == layout.vpp:
            return
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=layout.tp,
                                             pipeline_model_parallel_size=layout.pp,
                                             virtual_pipeline_model_parallel_size=layout.vpp,
                                             context_parallel_size=layout.cp,
                                             expert_model_parallel_size=layout.ep,
                                             expert_tensor_parallel_size=layout.expert_tp)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def destroy_megatron_parallel() -> None:
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
