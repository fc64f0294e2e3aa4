"""The router load-balancing loss of the global batch when its rows are spread over data-parallel ranks.

Transformers' MoE models compute the Switch-Transformer auxiliary loss (`load_balancing_loss_func`) over
the rows they see: aux = E · Σ_e (C_e / R) · (P_e / R), with C_e the top-k assignments to expert e, P_e
the summed router probabilities of e and R the rows, all summed over the (unmasked) rows of every layer.
A rank that sees only its share of the batch would compute another statistic. But C, P and R are sums
over rows, so the global value follows from sums over the ranks:

- C and R carry no gradient (top-k choices and the attention mask): they are all-reduced;
- P carries the gradient through this rank's rows only: each rank keeps its own P^r and returns the share
  s_r = E · Σ_e C_e · P^r_e / R², whose sum over the ranks is the global aux loss and whose gradient is
  this rank's part of the global aux loss's gradient.

The caller weights the share by the global micro-batch's trained tokens (one process weights its aux by
its tokens), so losses, gradients and the reported aux_loss are those of one process on the global batch.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def _statistics(router_logits: tuple[torch.Tensor, ...], num_experts: int, top_k: int,
                mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(C, P, R) of this rank's rows over all layers, as Transformers' load_balancing_loss_func sums them."""
    device = router_logits[0].device
    weight = None if mask is None else mask.reshape(-1).to(device, torch.float32)
    counts = torch.zeros(num_experts, dtype=torch.float32, device=device)
    prob_sum = torch.zeros(num_experts, dtype=torch.float32, device=device)
    rows = torch.zeros((), dtype=torch.float32, device=device)
    for logits in router_logits:
        probs = torch.softmax(logits.to(device), dim=-1)
        chosen = torch.topk(probs, top_k, dim=-1).indices.reshape(-1)
        row_weight = torch.ones(probs.shape[0], device=device) if weight is None else weight
        counts = counts.index_add(0, chosen, row_weight.repeat_interleave(top_k).detach())
        prob_sum = prob_sum + (probs.float() * row_weight[:, None]).sum(dim=0)
        rows = rows + row_weight.sum()
    return counts, prob_sum, rows


def global_aux_loss_share(router_logits: tuple[torch.Tensor, ...], num_experts: int, top_k: int,
                          mask: torch.Tensor | None, num_tokens: int, group) -> tuple[torch.Tensor, torch.Tensor, int]:
    """This rank's share of the global aux loss, the global aux value (detached) and the global trained tokens.

    Every rank of `group` must call it: one all-reduce of C, P (detached, for the value), R and the tokens.
    """
    counts, prob_sum, rows = _statistics(router_logits, num_experts, top_k, mask)
    tokens = torch.tensor([float(num_tokens)], device=counts.device)
    totals = torch.cat([counts, prob_sum.detach(), rows[None], tokens]).double()
    dist.all_reduce(totals, op=dist.ReduceOp.SUM, group=group)
    global_counts, global_probs = totals[:num_experts].float(), totals[num_experts:2 * num_experts].float()
    global_rows, global_tokens = totals[-2].float(), int(totals[-1])
    share = num_experts * (global_counts * prob_sum).sum() / global_rows ** 2
    value = num_experts * (global_counts * global_probs).sum() / global_rows ** 2
    return share, value, global_tokens
