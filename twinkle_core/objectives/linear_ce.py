"""Cross-entropy of the output layer's logits, summed over tokens, computed a chunk of tokens at a time, so
no [tokens, vocab] fp32 tensor exists at once (the fused linear cross-entropy of Liger and Unsloth).

For each chunk the logits are computed (in the autocast dtype when autocast is on, as the output layer would),
their log-sum-exp taken in fp32, and, when a gradient is wanted, the gradient of the chunk's loss with respect
to the logits (softmax - one-hot, cast to the logits' dtype, exactly what autograd would back-propagate into
the output layer) multiplied out at once into the hidden states' gradient (and the output weight's, when it
trains). The loss is the last operation of the step, so the forward pass can hold the gradients; backward only
scales them by the incoming gradient (1 for the loss itself).

Why: in SFT on a 49k vocabulary, the unfused logits of 200 trained tokens are a 40 MB fp32 tensor that is cast,
log-softmaxed and back-propagated through 4 more tensors of that size; each is a fresh allocation the
allocator maps and faults in again (on 2 CPU cores that was a quarter of a LoRA step). Chunks stay small enough
to be reused from the heap. The result equals F.cross_entropy(logits.float(), targets, reduction="sum") up to
the order of the chunked sums.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK_ELEMENTS = 1 << 23  # logits per chunk: 32 MB in fp32 (fewer rows make the output matmul slow)


def _compute_dtype(tensor: torch.Tensor) -> torch.dtype:
    device = tensor.device.type
    autocast = torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device)
    return torch.get_autocast_dtype(device) if autocast else tensor.dtype


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk, dtype, grad_hidden, grad_weight):
        w = weight.to(dtype)
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        d_hidden = torch.empty_like(hidden) if grad_hidden else None
        d_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if grad_weight else None
        for start in range(0, hidden.shape[0], chunk):
            h = hidden[start:start + chunk].to(dtype)
            t = targets[start:start + chunk]
            log_probs = torch.log_softmax((h @ w.t()).float(), dim=-1)
            loss -= log_probs.gather(1, t[:, None]).sum()
            if grad_hidden or grad_weight:
                grad = log_probs.exp_()  # softmax, in place
                grad[torch.arange(t.shape[0], device=t.device), t] -= 1
                grad = grad.to(dtype)
                if grad_hidden:
                    d_hidden[start:start + chunk] = grad @ w
                if grad_weight:
                    d_weight += (grad.t() @ h).float()
        ctx.save_for_backward(*(g for g in (d_hidden, d_weight) if g is not None))
        ctx.flags = (grad_hidden, grad_weight, weight.dtype)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        grad_hidden, grad_weight, weight_dtype = ctx.flags
        saved = list(ctx.saved_tensors)
        d_hidden = d_weight = None
        if grad_hidden:
            d_hidden = saved.pop(0)
            d_hidden = d_hidden * grad_loss.to(d_hidden.dtype)
        if grad_weight:
            d_weight = (saved.pop(0) * grad_loss).to(weight_dtype)
        return d_hidden, d_weight, None, None, None, None, None


def linear_cross_entropy_sum(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                             chunk_elements: int = CHUNK_ELEMENTS) -> torch.Tensor:
    """sum over rows of cross_entropy(hidden @ weight.T, targets): hidden [N, H], weight [V, H], targets [N]."""
    chunk = max(1, chunk_elements // weight.shape[0])
    grad_on = torch.is_grad_enabled()
    return _LinearCrossEntropy.apply(hidden, weight, targets, chunk, _compute_dtype(hidden),
                                     grad_on and hidden.requires_grad, grad_on and weight.requires_grad)


def fusable_head(head: torch.nn.Module) -> bool:
    """An output layer the fused loss may bypass: a plain bias-free nn.Linear on plain tensors (not a LoRA or fp8
    wrapper, not a tensor-parallel DTensor, whose logits a plain matmul would not gather)."""
    if type(head) is not torch.nn.Linear or head.bias is not None:
        return False
    return type(head.weight) is torch.nn.Parameter or type(head.weight) is torch.Tensor


class _LinearTargetLogProbs(torch.autograd.Function):
    """log softmax(hidden @ weight.T)[target] per row, a chunk of rows at a time; backward recomputes each
    chunk's softmax from the saved log-sum-exp (memory: one chunk of logits, not [rows, vocab])."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk, dtype):
        w = weight.to(dtype)
        accumulate = torch.promote_types(dtype, torch.float32)  # fp32 at least, as log_softmax(logits.float())
        out = torch.empty(hidden.shape[0], dtype=accumulate, device=hidden.device)
        lse = torch.empty_like(out)
        for start in range(0, hidden.shape[0], chunk):
            logits = (hidden[start:start + chunk].to(dtype) @ w.t()).to(accumulate)
            lse[start:start + chunk] = torch.logsumexp(logits, dim=-1)
            picked = logits.gather(1, targets[start:start + chunk, None])[:, 0]
            out[start:start + chunk] = picked - lse[start:start + chunk]
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.chunk, ctx.dtype = chunk, dtype
        return out

    @staticmethod
    def backward(ctx, grad_out):
        hidden, weight, targets, lse = ctx.saved_tensors
        w = weight.to(ctx.dtype)
        d_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        d_weight = torch.zeros(weight.shape, dtype=lse.dtype, device=weight.device) \
            if ctx.needs_input_grad[1] else None
        for start in range(0, hidden.shape[0], ctx.chunk):
            h = hidden[start:start + ctx.chunk].to(ctx.dtype)
            g = grad_out[start:start + ctx.chunk].to(lse.dtype)
            # d log p[t] / d logits = one-hot(t) - softmax
            grad = torch.exp((h @ w.t()).to(lse.dtype) - lse[start:start + ctx.chunk, None]).mul_(-g[:, None])
            grad[torch.arange(g.shape[0], device=g.device), targets[start:start + ctx.chunk]] += g
            grad = grad.to(ctx.dtype)
            if d_hidden is not None:
                d_hidden[start:start + ctx.chunk] = grad @ w
            if d_weight is not None:
                d_weight += (grad.t() @ h).to(lse.dtype)
        return d_hidden, None if d_weight is None else d_weight.to(weight.dtype), None, None, None


def linear_target_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                           chunk_elements: int = CHUNK_ELEMENTS) -> torch.Tensor:
    """log_softmax(hidden @ weight.T)[row, targets[row]] for hidden [N, H], weight [V, H], targets [N]: the
    per-token log-probabilities Tinker's losses take, with autograd, never holding [N, V] logits at once."""
    chunk = max(1, chunk_elements // weight.shape[0])
    return _LinearTargetLogProbs.apply(hidden, weight, targets, chunk, _compute_dtype(hidden))
