"""The Tinker wire format on the server side: protobuf request bodies in, protobuf results out.

The SDK sends forward_backward as a `tinker_public_pb2.ForwardBackwardRequest` and reads ForwardBackwardOutput
and SampleResponse results as protobuf too (`tinker.proto.response_conv`). Its own converters only go the
client's way, so this module is their inverse, written against the SDK's message definitions (never copies):
tokens are int32 bytes, tensors dense or sparse-CSR bytes of float32/int64, per-datum outputs one
BatchedTensor per field with byte offsets.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from tinker.proto import tinker_public_pb2 as pb

from twinkle_core.errors import UserError

_NUMPY = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32}
_PROTO = {np.dtype(np.float32): pb.DTYPE_FLOAT32, np.dtype(np.int64): pb.DTYPE_INT64}


MAX_TOPK = 20  # top tokens a position that sampling returns, at most (topk_*_logprobs)


class WireError(UserError):
    """A request body the server cannot read (answered 400)."""


@dataclass
class DatumIn:
    """One training row: its input tokens and its loss inputs, each an array of the same length."""

    tokens: np.ndarray
    inputs: dict[str, np.ndarray] = field(default_factory=dict)


@dataclass
class ForwardBackwardIn:
    model_id: str
    seq_id: int
    loss_fn: str
    config: dict[str, float | str]
    data: list[DatumIn]
    forward_only: bool


def _array(tensor: pb.Tensor, name: str) -> np.ndarray:
    dtype = _NUMPY.get(tensor.dtype)
    if dtype is None:
        raise WireError(f"loss input {name!r}: unsupported dtype {tensor.dtype} (float32 or int64)")
    shape = list(tensor.shape)
    if tensor.HasField("sparse_csr"):
        csr = tensor.sparse_csr
        values = np.frombuffer(csr.values, dtype=dtype)
        crow = np.frombuffer(csr.crow_indices, dtype=np.int64)
        col = np.frombuffer(csr.col_indices, dtype=np.int64)
        if len(shape) != 2 or len(crow) != shape[0] + 1 or len(col) != len(values) or (len(crow) and crow[-1] != len(values)):
            raise WireError(f"loss input {name!r}: malformed sparse CSR tensor of shape {shape}")
        dense = np.zeros(shape, dtype=dtype)
        rows = np.repeat(np.arange(shape[0]), np.diff(crow))
        if len(col) and (col.min() < 0 or col.max() >= shape[1]):
            raise WireError(f"loss input {name!r}: sparse column index outside shape {shape}")
        dense[rows, col] = values
        return dense
    values = np.frombuffer(tensor.dense, dtype=dtype).copy()
    if shape and int(np.prod(shape)) != values.size:
        raise WireError(f"loss input {name!r}: {values.size} values for shape {shape}")
    return values.reshape(shape) if shape else values


def decode_forward_backward(body: bytes, forward_only_path: bool) -> ForwardBackwardIn:
    """A forward_backward (or forward) request body, checked for shape only; the engine checks values."""
    message = pb.ForwardBackwardRequest()
    try:
        message.ParseFromString(body)
    except Exception as exc:  # protobuf raises its own DecodeError
        raise WireError(f"forward_backward: the body is not a ForwardBackwardRequest protobuf ({exc})") from None
    config: dict[str, float | str] = {k: float(v) for k, v in message.loss_fn_config.items()}
    for key, value in message.loss_fn_config_v2.items():
        config[key] = value.text if value.WhichOneof("value") == "text" else float(value.number)
    data = []
    for i, datum in enumerate(message.data):
        chunks = []
        for chunk in datum.model_input:
            if chunk.WhichOneof("chunk") != "encoded_text":
                raise WireError(f"datum {i}: only token chunks are supported by this server (got "
                                f"{chunk.WhichOneof('chunk')!r}); it serves a text-only base model")
            chunks.append(np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32))
        tokens = np.concatenate(chunks).astype(np.int64) if chunks else np.zeros(0, dtype=np.int64)
        inputs = {name: _array(tensor, name) for name, tensor in datum.loss_fn_inputs.items()}
        data.append(DatumIn(tokens, inputs))
    return ForwardBackwardIn(message.model_id, message.seq_id, message.loss_fn, config, data,
                             bool(message.forward_only) or forward_only_path)


def encode_forward_backward(outputs: list[dict[str, np.ndarray]], metrics: dict[str, float]) -> bytes:
    """A ForwardBackwardOutput: one ArrayRecord, each field one BatchedTensor of every datum's values."""
    message = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    for key, value in metrics.items():
        message.metrics[key] = float(value)
    record = message.loss_fn_outputs.add(num_datums=len(outputs))
    for name in (outputs[0] if outputs else {}):
        arrays = [np.ascontiguousarray(out[name]) for out in outputs]
        dtype = arrays[0].dtype
        sizes = [a.nbytes for a in arrays]
        batched = record.fields[name]
        batched.dtype = _PROTO[dtype]
        batched.data = b"".join(a.tobytes() for a in arrays)
        batched.offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64).tobytes()
        batched.trailing_shape.extend(arrays[0].shape[1:])
    return message.SerializeToString()


def encode_sample(sequences: list[tuple], prompt: tuple | None = None) -> bytes:
    """A SampleResponse: each sequence's tokens (int32), logprobs (float32), stop reason and top-k logprobs; the
    prompt's logprobs and top-k logprobs (TinkerEngine.sample's results)."""
    message = pb.SampleResponse()
    for tokens, logprobs, stop, top in sequences:
        seq = message.sequences.add()
        seq.tokens = np.asarray(tokens, dtype=np.int32).tobytes()
        if logprobs is not None:
            seq.logprobs = np.asarray(logprobs, dtype=np.float32).tobytes()
        seq.stop_reason = pb.STOP_REASON_LENGTH if stop == "length" else pb.STOP_REASON_STOP
        if top is not None:
            _topk(seq.topk_sampled_logprobs, *top)
    prompt_logprobs, top = prompt or (None, None)
    if prompt_logprobs is not None:
        message.prompt_logprobs = np.asarray(prompt_logprobs, dtype=np.float32).tobytes()
    if top is not None:
        _topk(message.topk_prompt_logprobs, *top)
    return message.SerializeToString()


def _topk(message: pb.TopkLogprobs, ids: np.ndarray, logprobs: np.ndarray) -> None:
    """Dense [positions, k] matrices, row-major (the SDK's TopkLogprobs)."""
    message.length, message.k = ids.shape
    message.token_ids = np.ascontiguousarray(ids, dtype=np.int32).tobytes()
    message.logprobs = np.ascontiguousarray(logprobs, dtype=np.float32).tobytes()
