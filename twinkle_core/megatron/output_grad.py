"""Keep megatron's output layer from materialising its weight once per sequence position in backward.

With a frozen output weight (LoRA, or multi-tenant LoRA), megatron-core's linear backward computes only
`grad_input = grad_output.matmul(weight)`, on the logits' gradient as it arrives: a [seq, batch, vocab]
view of GPTModel's transposed [batch, seq, vocab] logits, so not contiguous. torch.matmul cannot fold such
a 3-D operand into one 2-D product, and broadcasts instead: it expands the [vocab, hidden] weight to
[seq, vocab, hidden] and copies it (measured: 6.9 GB for SmolLM2-135M at 128 tokens, on CPU; the same
code runs on GPU). Making that gradient contiguous first turns it into one [seq·batch, vocab] @ [vocab,
hidden] product with the same result. Trained output weights take megatron's other branch, which already
flattens the gradient.
"""
from __future__ import annotations

import torch


class _ContiguousGrad(torch.autograd.Function):
    """Identity forward; backward hands on a contiguous copy of the gradient."""

    @staticmethod
    def forward(ctx, tensor):
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def _contiguous_logit_grad(module, args, output):
    logits, bias = output
    return _ContiguousGrad.apply(logits), bias


def keep_output_grad_contiguous(model) -> None:
    """Hook the output layer of `model` (a GPTModel chunk holding the last stage); no-op elsewhere."""
    output_layer = getattr(model, "output_layer", None)
    if output_layer is not None:
        output_layer.register_forward_hook(_contiguous_logit_grad)
