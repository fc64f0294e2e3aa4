"""The CPU device mode: what it redirects, that it undoes itself, and that it stays off where CUDA exists."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from twinkle_core.megatron import cpu_device_mode, disable_cpu_device_mode, enable_cpu_device_mode, is_cpu_device_mode

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the mode only exists on machines without CUDA")


@pytest.fixture
def mode_on():
    assert enable_cpu_device_mode() is True
    yield
    disable_cpu_device_mode()


def test_cuda_tensor_requests_land_on_the_cpu(mode_on):
    assert torch.zeros(2, device="cuda").device.type == "cpu"
    assert torch.empty(3, device=torch.cuda.current_device()).device.type == "cpu"  # megatron's idiom
    assert torch.ones(2, device=torch.device("cuda", 0)).device.type == "cpu"
    with torch.device(torch.cuda.current_device()):  # megatron's YaRN rope builds its tables this way
        assert torch.zeros(1).device.type == "cpu"
    tensor = torch.arange(4.0)
    assert tensor.cuda() is tensor
    assert tensor.to("cuda").device.type == "cpu"
    assert tensor.to(torch.float64).dtype == torch.float64  # other .to() calls are untouched
    assert tensor.type() == "torch.cuda.FloatTensor"  # the distributed optimizer groups by these strings
    assert tensor.type(torch.float64).dtype == torch.float64


def test_streams_events_and_synchronize_are_no_ops(mode_on):
    stream = torch.cuda.current_stream()
    with torch.cuda.stream(torch.cuda.Stream()):
        event = torch.cuda.Event()
        event.record()
        stream.wait_event(event)
    torch.cuda.synchronize()
    assert event.query()


def test_megatron_rng_tracker_forks_reproducibly_and_restores_the_cpu_stream(mode_on):
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    tracker = get_cuda_rng_tracker()
    tracker.reset()
    torch.manual_seed(1)
    tracker.add("model-parallel-rng", 1234)
    with tracker.fork():
        first = torch.rand(3)
    after_fork = torch.rand(3)
    torch.manual_seed(1)
    tracker.reset()
    tracker.add("model-parallel-rng", 1234)
    with tracker.fork():
        again = torch.rand(3)
    assert torch.equal(first, again)
    assert torch.equal(after_fork, torch.rand(3))  # the CPU stream continued as if no fork happened
    tracker.reset()


def test_moe_helpers_work_without_transformer_engine(mode_on):
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    assert moe_utils.te_general_gemm is None
    split_sizes = token_dispatcher.maybe_move_tensor_to_cpu(torch.tensor([2, 3]), as_numpy=True)
    assert isinstance(split_sizes, np.ndarray) and split_sizes.tolist() == [2, 3]


def test_disable_restores_everything():
    original = (torch.cuda.current_device, torch.cuda.synchronize, torch.cuda.Stream, torch.cuda.random.get_rng_state)
    with cpu_device_mode() as on:
        assert on and is_cpu_device_mode()
        assert torch.cuda.current_device() == torch.device("cpu")
    assert not is_cpu_device_mode()
    assert (torch.cuda.current_device, torch.cuda.synchronize, torch.cuda.Stream,
            torch.cuda.random.get_rng_state) == original
    assert torch.arange(2.0).type() == "torch.FloatTensor"
    with pytest.raises((RuntimeError, AssertionError)):
        torch.zeros(1, device="cuda")  # no CUDA here: the request fails as it does without the mode


def test_inactive_where_cuda_exists(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    current_device = torch.cuda.current_device
    assert enable_cpu_device_mode() is False
    assert not is_cpu_device_mode()
    assert torch.cuda.current_device is current_device
    with cpu_device_mode() as on:
        assert on is False
    assert torch.arange(2.0).type() == "torch.FloatTensor"
