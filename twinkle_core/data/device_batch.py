"""A collated batch on the model's device, with its host copy.

The step reads counts and trained positions from the batch as collated, on the host (`Batch.host`), and a
padding-free batch's layout stays there (HOST_KEYS): on a GPU the step then queues its work without waiting for
the device (a read of a device value, `int(mask.sum())` or a boolean index, would wait for all queued work).
"""
from __future__ import annotations

import contextlib
import contextvars

import torch

# A padding-free batch's layout: the attention reads it on the host (twinkle_core.models.attention).
HOST_KEYS = ("cu_seq_lens_q", "prefix_spans")


class Batch(dict):
    """A batch's tensors on the model's device (HOST_KEYS on the host); `host`: all of them as collated."""

    host: dict[str, torch.Tensor]


def to_device(inputs: dict, device: torch.device) -> Batch:
    """`inputs` (tensors or lists) as a Batch on `device`; copies to a CUDA device are asynchronous (pinned memory)."""
    host = {k: torch.as_tensor(v) for k, v in inputs.items()}
    batch = Batch({k: v if k in HOST_KEYS else to_device_async(v, device) for k, v in host.items()})
    batch.host = host
    return batch


def to_device_async(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`tensor` on `device`; from the host to a CUDA device through pinned memory, without waiting for the device."""
    if device.type == "cuda" and tensor.device.type == "cpu":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def host_of(batch: dict) -> dict[str, torch.Tensor] | None:
    """The host tensors of a batch built by to_device (None for any other dict, or when its labels changed since)."""
    host = getattr(batch, "host", None)
    if host is None or ("labels" in batch and host.get("labels") is not None and
                        host["labels"].shape != batch["labels"].shape):
        return None
    return host


# Set while a padding-free batch runs forward: its attention (twinkle_core.models.attention) keeps the samples
# apart and needs no mask; Transformers' sdpa mask would first check on the device that its all-ones mask is all
# ones.
_PADDING_FREE = contextvars.ContextVar("twinkle_padding_free", default=False)


@contextlib.contextmanager
def padding_free_forward(inputs: dict):
    """Around a model forward of `inputs`: when they are a padding-free batch (cu_seq_lens_q), no attention mask
    is built."""
    token = _PADDING_FREE.set("cu_seq_lens_q" in inputs)
    try:
        yield
    finally:
        _PADDING_FREE.reset(token)


def in_padding_free_forward() -> bool:
    return _PADDING_FREE.get()
