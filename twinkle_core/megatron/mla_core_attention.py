"""Core attention for multi-latent attention on megatron-core's local spec: plain torch SDPA.

megatron-core 0.16's local `DotProductAttention` assumes keys and values of one width (`kv_channels`),
and its constructor rejects the `k_channels` / `v_channels` that MLA passes (DeepSeek: 192-wide query/key
heads, 128-wide value heads); only the Transformer-Engine spec handles them. This module takes the same
arguments and inputs ([seq, batch, heads, dim] query/key/value) and returns [seq, batch, heads × v_dim],
computing causal attention with `torch.nn.functional.scaled_dot_product_attention` at MLA's softmax scale.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule


class MLACoreAttention(MegatronModule):
    """Causal attention whose key and value heads differ in width, for MLASelfAttention's `core_attention`."""

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 k_channels: int | None = None, v_channels: int | None = None, cp_comm_type=None,
                 pg_collection=None):
        super().__init__(config=config)
        if config.context_parallel_size > 1:
            raise ValueError(f"context_parallel_size={config.context_parallel_size}: multi-latent attention on the "
                             "local spec has no context parallelism; use the Transformer-Engine spec (GPU).")
        self.softmax_scale = softmax_scale or 1.0 / math.sqrt(k_channels or config.kv_channels)
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("multi-latent attention on the local spec takes neither packed sequences nor an "
                             "attention bias; use the Transformer-Engine spec (GPU) for them.")
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [batch, heads, seq, dim]
        mask = None
        if attention_mask is not None:  # megatron's masks are True where attention is *not* allowed
            causal = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
            mask = causal & ~attention_mask
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                             dropout_p=self.dropout if self.training else 0.0,
                                             scale=self.softmax_scale)
        seq, batch = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(seq, batch, -1)
