"""The attention a Transformers causal LM trains with here (`twinkle_sdpa`): SDPA's, with two CPU paths and
padding-free batches. Measured on 2 cores, SmolLM2-135M (9 heads x 64), LoRA, bf16 (bench/bench_sft.py).

- **Padding-free batches** (twinkle_core.data.collate_padding_free): a micro-batch's samples lie end to end in
  one row, position ids restarting per sample, with `cu_seq_lens_q` (the sample boundaries, the name flash-
  attention kernels read). The linear layers then run over real tokens only. Attention keeps samples apart:
  short or even samples are laid out as a right-padded batch for one kernel call (causal attention never lets a
  real token see the padding after it; the padding's outputs are dropped); long samples of uneven lengths
  attend one sample at a time, which does a fraction of a padded batch's work (1.23x on the 50-1000-token set).
- **Shared prefixes** (`prefix_spans`, twinkle_core.data.PaddingFreeRow): a sample may continue a span of tokens
  already in the row (the system prompt every SFT row starts with, a DPO pair's prompt, a GRPO group's prompt)
  and attends to it as if it came first; the span is laid in front of the sample's own tokens inside the
  attention only, so every other layer runs over it once.
- **Short sequences on CPU** (scores of at most MATH_ATTENTION_SCORES): softmax(q k^T) v as plain matmuls with an
  fp32 softmax (Transformers' eager attention). PyTorch's CPU flash kernel pays a fixed cost per call that
  dominates at these sizes: a 60-token micro-batch of 8 took 5.9 ms per layer (forward + backward) there.
- **Longer sequences on CPU in bf16/fp16**: the flash kernel, with q, k and v upcast to fp32 (it is about 1.5x
  faster in fp32 than in bf16 here: 41 against 59 ms for 8 x 300 tokens); more precise, not less.

fp32 runs give SDPA's results within rounding; CUDA keeps SDPA's own kernels. Every other case (decoding with a
cache, masks other than causal) goes to Transformers' `sdpa_attention_forward`, with Transformers' sdpa masks (the
mask function is registered under this name), so padded batches, left-padded generation and 4-D packed masks
behave exactly as with `attn_implementation="sdpa"`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.weak import WeakTensorKeyDictionary

from twinkle_core.data.device_batch import in_padding_free_forward, to_device_async

ATTENTION_NAME = "twinkle_sdpa"
_HALF = (torch.bfloat16, torch.float16)
# The math path's fp32 scores per call (b x heads x s x s), kept for backward per layer: at most 1M (4 MB). Beyond,
# the flash kernel is as fast here (1000-token samples) and holds no scores.
MATH_ATTENTION_SCORES = 1 << 20
# Padding-free samples at least this long, of lengths uneven enough, attend one sample at a time.
LOOP_MIN_LENGTH = 256
LOOP_WASTE = 1.5  # ... when a padded batch would do this many times the attention work of the samples


def _upcast(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    if tensors[0].device.type == "cpu" and tensors[0].dtype in _HALF:
        return tuple(t.float() for t in tensors)
    return tensors


def _math_attention(module, query, key, value, mask, scaling):
    """softmax(q k^T * scale + mask) v with the softmax in fp32: Transformers' eager attention, on CPU faster than
    the flash kernel for short sequences (it is what `attn_implementation="eager"` computes). `mask`: a boolean
    [b or 1, 1, s, s] mask of allowed keys, or None for causal."""
    from transformers.integrations.sdpa_attention import repeat_kv

    groups = query.shape[1] // key.shape[1]
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    scores = torch.matmul(query, key.transpose(-1, -2)).float() * scale
    if mask is None:
        length = query.shape[2]
        mask = torch.ones(length, length, dtype=torch.bool, device=query.device).tril()[None, None]
    scores = scores.masked_fill(~mask, torch.finfo(torch.float32).min)
    probs = torch.softmax(scores, dim=-1).to(value.dtype)
    return torch.matmul(probs, value).transpose(1, 2).contiguous()


def _attention(module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs):
    """[b, s, heads, d]: the math path for short sequences on CPU, else SDPA (upcast on CPU in half precision)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    batch, heads, length, _ = query.shape
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    small = batch * heads * length * key.shape[2] <= MATH_ATTENTION_SCORES and length == key.shape[2]
    if query.device.type == "cpu" and small and not dropout and causal and \
            (attention_mask is None or attention_mask.dtype == torch.bool):
        return _math_attention(module, query, key, value, attention_mask, scaling)
    dtype = query.dtype
    out, _ = sdpa_attention_forward(module, *_upcast(query, key, value), attention_mask, dropout, scaling, is_causal,
                                    **kwargs)
    return out.to(dtype)


def _segments(bounds: torch.Tensor, prefixes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """For samples laid end to end (offsets `bounds`), each reading first the span (start, length) of the row in
    `prefixes` ([samples, 2]; length 0: none): the index that lays them out as a right-padded [samples, longest]
    batch (a row reads its prefix span, then its own tokens; padding repeats the sample's first token), the flat
    positions of the outputs to keep (each sample's own tokens), the number of samples and the longest row.
    Computed where `bounds` lie (the host, for the batches the models build)."""
    starts, lengths = bounds[:-1].long(), (bounds[1:] - bounds[:-1]).long()
    lead, lead_start = prefixes[:, 1:].long(), prefixes[:, :1].long()
    rows = lead[:, 0] + lengths
    longest = int(rows.max())
    steps = torch.arange(longest, device=bounds.device)[None, :]
    real = steps < rows[:, None]
    own = torch.where(real, starts[:, None] + steps - lead, starts[:, None])
    index = torch.where(steps < lead, lead_start + steps, own)
    keep = real & (steps >= lead)
    return index.flatten(), torch.nonzero(keep.flatten()).flatten(), len(lengths), longest


@dataclass(frozen=True)
class _Layout:
    """How one padding-free batch attends, worked out once for all layers: the samples' spans as host integers
    (start, end, prefix start, prefix length), and for the padded path the gather and keep indices on the device."""

    spans: list[tuple[int, int, int, int]]
    per_sample: bool
    index: torch.Tensor | None = None
    keep: torch.Tensor | None = None
    samples: int = 0
    longest: int = 0


# One layout per batch (keyed by its cu_seq_lens_q tensor): every layer, and a recomputed forward, reuse it.
_LAYOUTS = WeakTensorKeyDictionary()


def _layout(cu_seq_lens_q: torch.Tensor, prefix_spans: torch.Tensor | None, device: torch.device) -> _Layout:
    """The batch's attention layout. The models keep `cu_seq_lens_q` and `prefix_spans` on the host
    (twinkle_core.models.batches.HOST_KEYS), so nothing here waits for the device; a caller that moved them
    there pays one wait per forward, not one per layer."""
    cached = _LAYOUTS.get(cu_seq_lens_q)
    if cached is not None and cached[0] is prefix_spans and cached[1] == device:
        return cached[2]
    bounds = cu_seq_lens_q.cpu()
    prefixes = torch.zeros(len(bounds) - 1, 2, dtype=torch.int32) if prefix_spans is None else prefix_spans.cpu()
    spans = [(start, end, lead_start, lead) for start, end, (lead_start, lead)
             in zip(bounds[:-1].tolist(), bounds[1:].tolist(), prefixes.tolist())]
    lengths = [end - start + lead for start, end, _, lead in spans]
    per_sample = max(lengths) >= LOOP_MIN_LENGTH and \
        len(lengths) * max(lengths) ** 2 > LOOP_WASTE * sum(n * n for n in lengths)
    if per_sample:
        layout = _Layout(spans, True)
    else:
        index, keep, samples, longest = _segments(bounds, prefixes)
        layout = _Layout(spans, False, to_device_async(index, device), to_device_async(keep, device), samples, longest)
    _LAYOUTS[cu_seq_lens_q] = (prefix_spans, device, layout)
    return layout


def twinkle_sdpa(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, is_causal=None,
                 cu_seq_lens_q: torch.Tensor | None = None, prefix_spans: torch.Tensor | None = None, **kwargs):
    """Transformers' attention-interface signature: q [b, heads, s, d], k/v [b, kv_heads, s, d] → [b, s, heads, d].

    `prefix_spans` ([samples, 2], twinkle_core.data.PaddingFreeRow): each sample first attends to the span
    (start, length) of the row, as if those tokens came before its own (a prompt prefix held once)."""
    if cu_seq_lens_q is None or query.shape[2] != key.shape[2]:  # no boundaries, or decoding with a cache
        return _attention(module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs), None
    if query.shape[0] != 1:
        raise ValueError(f"padding-free attention takes one row of samples laid end to end; got a batch of "
                         f"{query.shape[0]}")
    layout = _layout(cu_seq_lens_q, prefix_spans, query.device)
    if layout.per_sample:
        # Long samples of uneven lengths: one kernel call per sample does a fraction of a padded batch's work.
        def sample(x, start, end, lead_start, lead):
            own = x[:, :, start:end]
            return torch.cat([x[:, :, lead_start:lead_start + lead], own], 2) if lead else own

        outs = [_attention(module, sample(query, *span), sample(key, *span), sample(value, *span), None, dropout,
                           scaling, True, **kwargs)[:, span[3]:]
                for span in layout.spans if span[1] > span[0]]
        return torch.cat(outs, dim=1), None
    # Short or even samples: a right-padded batch for one kernel call. Causal attention never lets a real token see
    # the padding after it, and the padding's outputs are dropped.
    def padded(x):
        return x[0][:, layout.index].unflatten(1, (layout.samples, layout.longest)).transpose(0, 1)

    out = _attention(module, padded(query), padded(key), padded(value), None, dropout, scaling, True, **kwargs)
    return out.flatten(0, 1).index_select(0, layout.keep)[None], None


def _mask(*args, **kwargs):
    """Transformers' sdpa mask, except in a padding-free forward (padding_free_forward), which needs none."""
    from transformers.masking_utils import sdpa_mask

    return None if in_padding_free_forward() else sdpa_mask(*args, **kwargs)


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    AttentionInterface.register(ATTENTION_NAME, twinkle_sdpa)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION_NAME, _mask)


def padding_free_problems(model: torch.nn.Module) -> list[str]:
    """Why `model` cannot train padding-free batches (empty: it can).

    It must hand its attention to Transformers' attention interface (the sample boundaries reach the kernel
    through it), use SDPA (a model that asked for eager attention or a flash kernel keeps it), and attend over
    whole sequences: a sliding window or linear-attention layers would need a mask per sample."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if config is not None else None
    if text is None or not getattr(type(model), "_supports_attention_backend", False):
        return [f"{type(model).__name__} does not pass attention through Transformers' attention interface"]
    if getattr(text, "_attn_implementation", None) not in ("sdpa", ATTENTION_NAME):
        return [f"attention implementation {text._attn_implementation!r} (padding-free batches use sdpa)"]
    other_layers = sorted({t for t in getattr(text, "layer_types", None) or () if t != "full_attention"})
    if other_layers:
        return [f"model_type {text.model_type!r} has {other_layers} layers"]
    if getattr(text, "sliding_window", None) and getattr(text, "use_sliding_window", True):
        return [f"model_type {text.model_type!r} attends within a sliding window of {text.sliding_window} tokens"]
    return []


def use_twinkle_sdpa(model: torch.nn.Module) -> bool:
    """Switch an SDPA causal LM to `twinkle_sdpa`; return whether it now runs padding-free batches."""
    if padding_free_problems(model):
        return False
    _register()
    if model.config._attn_implementation != ATTENTION_NAME:
        model.set_attn_implementation(ATTENTION_NAME)
    return True
