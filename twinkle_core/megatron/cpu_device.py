"""megatron-core's "CPU device" mode: run its local (non-Transformer-Engine) layers on the CPU over gloo.

megatron-core is written for CUDA: it creates tensors with `device=torch.cuda.current_device()`, calls
`.cuda()`, synchronizes streams, forks the CUDA RNG for tensor-parallel initialization and compares
`tensor.type()` strings with `torch.cuda.FloatTensor`. With its local layer spec nothing else needs a GPU,
so on a machine without CUDA this mode redirects exactly those requests to the CPU:

- a `TorchFunctionMode` that rewrites `device='cuda'` / `device=<int>` arguments, `torch.device(0)`,
  `Tensor.cuda()` and `Tensor.to('cuda')` to the CPU, and makes argument-less `Tensor.type()` answer
  `torch.cuda.*Tensor`;
- `torch.cuda.current_device()` answering the CPU device (backward passes of megatron's autograd functions
  run outside the function mode and allocate with it), and stand-ins for `torch.cuda.synchronize / current_stream / Stream / Event / stream`, and
  the CUDA RNG state functions (torch's and megatron's `tensor_parallel.random` copies), backed by the CPU
  generator (megatron saves, seeds, reads and restores them, so the CPU stream comes out as it went in);
- for MoE: `moe_utils.te_general_gemm = None` (0.16.1 leaves it undefined without Transformer Engine) and
  `maybe_move_tensor_to_cpu(..., as_numpy=True)` returning numpy for CPU tensors too (else gloo's
  all_to_all receives tensors as split sizes);
- for multi-latent attention: `multi_latent_attention.HAVE_TE = False` where its Transformer-Engine import
  handed back MagicMock stand-ins (0.16.1 then calls `isinstance(..., <MagicMock>)` and fails).

It is switched on explicitly (`enable_cpu_device_mode()`, or `with cpu_device_mode():`), never by import,
and refuses to do anything where CUDA exists: there megatron-core runs as written. The function mode is
per thread, so enable it in the thread that runs megatron (the torchrun worker's main thread).
"""
from __future__ import annotations

import contextlib
import logging
from typing import Callable

import torch
from torch.overrides import TorchFunctionMode

logger = logging.getLogger(__name__)

_CPU = torch.device("cpu")


def _is_cuda_device(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.split(":")[0] == "cuda"
    return isinstance(device, int) and not isinstance(device, bool)  # megatron passes current_device() (0)


def _cpu_if_cuda(value):
    return _CPU if _is_cuda_device(value) else value


class CudaToCpuFunctionMode(TorchFunctionMode):
    """Rewrites CUDA device requests to the CPU and reports CPU tensors as `torch.cuda.*Tensor` types."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if "device" in kwargs:
            kwargs["device"] = _cpu_if_cuda(kwargs["device"])
        if func is torch.device and args and _is_cuda_device(args[0]):
            return _CPU  # torch.device(0) / torch.device("cuda"), e.g. for `with torch.device(...)`
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            # The distributed optimizer groups parameters by these strings, spelled the CUDA way.
            return func(*args).replace("torch.", "torch.cuda.", 1)
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], _CPU, *args[2:])
        return func(*args, **kwargs)


class _Stream:
    """What megatron needs of a CUDA stream: a no-op wait/synchronize and use as a context."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self, event=None):
        return event or _Event()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass


class _Event:
    """A CUDA event on a device whose work is already done when Python sees it."""

    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


def _cpu_rng_state(device=None, clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    return torch.get_rng_state()


def _set_cpu_rng_state(new_state: torch.Tensor, device=None, graph_safe: bool = False) -> None:
    torch.set_rng_state(new_state)


def _seed_cpu_generator(seed: int) -> None:
    torch.manual_seed(seed)


def _numpy_for_cpu_tensors(original: Callable) -> Callable:
    def maybe_move_tensor_to_cpu(tensor, as_numpy: bool = False, record_stream: bool = False):
        if as_numpy and isinstance(tensor, torch.Tensor) and tensor.device.type == "cpu":
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    return maybe_move_tensor_to_cpu


class _Patches:
    """Attribute replacements that remember the originals, so the mode can be switched off again."""

    def __init__(self):
        self._saved: list[tuple[object, str, object, bool]] = []

    def set(self, owner, name: str, value) -> None:
        had = hasattr(owner, name)
        self._saved.append((owner, name, getattr(owner, name, None), had))
        setattr(owner, name, value)

    def restore(self) -> None:
        for owner, name, value, had in reversed(self._saved):
            if had:
                setattr(owner, name, value)
            else:
                delattr(owner, name)
        self._saved.clear()


def _patch_torch_cuda(patches: _Patches) -> None:
    cuda = torch.cuda
    # The CPU device itself, not index 0: custom autograd backward passes (sequence-parallel reduce-scatters)
    # run outside any TorchFunctionMode, so `device=current_device()` must name the CPU on its own.
    patches.set(cuda, "current_device", lambda: _CPU)
    patches.set(cuda, "synchronize", lambda device=None: None)
    patches.set(cuda, "current_stream", lambda device=None: _Stream())
    patches.set(cuda, "default_stream", lambda device=None: _Stream())
    patches.set(cuda, "Stream", _Stream)
    patches.set(cuda, "Event", _Event)
    patches.set(cuda, "stream", lambda stream=None: contextlib.nullcontext(stream))
    patches.set(cuda, "get_rng_state", _cpu_rng_state)
    patches.set(cuda, "set_rng_state", _set_cpu_rng_state)
    patches.set(cuda, "manual_seed", _seed_cpu_generator)
    patches.set(cuda.random, "get_rng_state", _cpu_rng_state)
    patches.set(cuda.random, "set_rng_state", _set_cpu_rng_state)


def _patch_megatron(patches: _Patches) -> None:
    from megatron.core.tensor_parallel import random as tp_random
    from megatron.core.transformer import multi_latent_attention
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    patches.set(tp_random, "_get_cuda_rng_state", _cpu_rng_state)
    patches.set(tp_random, "_set_cuda_rng_state", _set_cpu_rng_state)
    if not hasattr(moe_utils, "te_general_gemm"):
        patches.set(moe_utils, "te_general_gemm", None)
    if not isinstance(multi_latent_attention.TELinear, type):  # without TE its import hands back MagicMocks
        patches.set(multi_latent_attention, "HAVE_TE", False)
    numpy_aware = _numpy_for_cpu_tensors(moe_utils.maybe_move_tensor_to_cpu)
    patches.set(moe_utils, "maybe_move_tensor_to_cpu", numpy_aware)
    patches.set(token_dispatcher, "maybe_move_tensor_to_cpu", numpy_aware)


class CpuDeviceMode:
    """The switched-on mode: the function mode on this thread's stack plus the attribute patches."""

    def __init__(self):
        self._patches = _Patches()
        self._function_mode = CudaToCpuFunctionMode()

    def enter(self) -> None:
        _patch_torch_cuda(self._patches)
        _patch_megatron(self._patches)
        self._function_mode.__enter__()

    def exit(self) -> None:
        self._function_mode.__exit__(None, None, None)
        self._patches.restore()


_active: CpuDeviceMode | None = None


def is_cpu_device_mode() -> bool:
    return _active is not None


def enable_cpu_device_mode() -> bool:
    """Switch the mode on in this thread when no CUDA device exists; True when it is (now) on.

    With CUDA it does nothing and returns False: megatron-core then runs on the GPU as written.
    """
    global _active
    if _active is not None:
        return True
    if torch.cuda.is_available():
        return False
    mode = CpuDeviceMode()
    mode.enter()
    _active = mode
    logger.info("megatron-core CPU device mode on: CUDA requests go to the CPU")
    return True


def disable_cpu_device_mode() -> None:
    """Undo `enable_cpu_device_mode` (restores every patched attribute); a no-op when it is off."""
    global _active
    if _active is not None:
        _active.exit()
        _active = None


@contextlib.contextmanager
def cpu_device_mode():
    """`with cpu_device_mode():` the mode for a block; yields whether it is on (False where CUDA exists)."""
    was_on = is_cpu_device_mode()
    on = enable_cpu_device_mode()
    try:
        yield on
    finally:
        if on and not was_on:
            disable_cpu_device_mode()
