"""Keep megatron's output layer from materialising its weight once per sequence position in backward.

With a frozen output weight (LoRA, or multi-tenant LoRA), megatron-core's linear backward computes only
`grad_input = grad_output.matmul(weight)`, on the logits' gradient as it arrives: a [seq, batch, vocab]
view of GPTModel's transposed [batch, seq, vocab] logits, so not contiguous. torch.matmul cannot fold such
a 3-D operand into one 2-D product, and broadcasts instead: it expands the [vocab, hidden] weight to
[seq, vocab, hidden] and copies it (measured: 6.9 GB for SmolLM2-135M at 128 tokens, on CPU; the same
code runs on GPU). Making that gradient contiguous first turns it into one [seq·batch, vocab] @ [vocab,
hidden] product with the same result. Trained output weights take megatron's other branch, which already
flattens the gradient.

The gradient is replaced by a hook on the logits tensor, not by an autograd Function around it: a Function
would hand on a view of the logits, and megatron's vocab-parallel cross-entropy edits the logits in place,
which autograd refuses for such views. (That was the error behind the tp=2 "hang": it was raised on the one
tp rank whose vocabulary slice has no padding and whose micro-batch of one row made the loss's input that
view itself; the other rank then waited in the backward's all-reduce.)
"""
from __future__ import annotations

import torch


def _contiguous(grad: torch.Tensor) -> torch.Tensor:
    return grad.contiguous()


def _contiguous_logit_grad(module, args, output) -> None:
    logits, _ = output
    if logits.requires_grad:
        logits.register_hook(_contiguous)


def keep_output_grad_contiguous(model) -> None:
    """Hook the output layer of `model` (a GPTModel chunk holding the last stage); no-op elsewhere."""
    output_layer = getattr(model, "output_layer", None)
    if output_layer is not None:
        output_layer.register_forward_hook(_contiguous_logit_grad)
