"""Mixed-tenant batches: rows of several tenants in one forward/backward, each tenant's loss kept apart.

The rows are put in tenant order (a stable sort), so each tenant's rows are one contiguous block: the
LoRA router then adapts them with slices (views, no gathers), and because the trained positions are
taken row by row, each tenant's trained tokens are one contiguous block of the selected logits too.

One backward over the sum of the tenants' summed losses gives every tenant exactly the gradient of its
own loss: a tenant's adapter only acts on its own rows, the base is frozen, and rows do not interact in
a causal LM (attention stays within a row). The router load-balancing loss of MoE models is the one
exception (a statistic over all rows of the batch), so mixed batches refuse it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from twinkle_core.models.batches import count_input_tokens
from twinkle_core.models.lora_routing import LoraRouter, RowGroup
from twinkle_core.models.loss import LossModule
from twinkle_core.objectives.causal_lm import IGNORE_INDEX, LossParts, causal_lm_loss_sum, trained_logits


def row_groups(names: list[str], order: list[str]) -> list[RowGroup]:
    """One row group per tenant of `order` over rows already sorted by tenant (`names`: each row's tenant).

    Tenants of `order` without rows here get an empty group (under data parallelism another rank has them).
    """
    groups, start = [], 0
    for name in order:
        stop = start + names.count(name)
        groups.append(RowGroup(name, start, stop))
        start = stop
    return groups


def seen_tokens(batch: dict[str, torch.Tensor], group: RowGroup) -> int:
    """Non-padding input tokens of the group's rows."""
    return count_input_tokens({k: batch[k][group.rows] for k in ("input_ids", "attention_mask") if k in batch})


def tenant_loss_sums(model: torch.nn.Module, batch: dict[str, torch.Tensor], groups: list[RowGroup]) -> list[LossParts]:
    """Each group's summed next-token cross-entropy and trained tokens, from one pass over the batch."""
    labels = batch["labels"]
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    targets = labels[:, 1:]
    selected = targets != IGNORE_INDEX
    logits, _ = trained_logits(model, inputs, selected)
    token_targets = targets[selected]
    per_row = selected.sum(dim=1).tolist()
    parts = []
    for group in groups:
        first = sum(per_row[:group.start])
        last = first + sum(per_row[group.rows])
        loss_sum = F.cross_entropy(logits[first:last].float(), token_targets[first:last], reduction="sum")
        parts.append(LossParts(loss_sum, last - first))
    return parts


class TenantLossModule(LossModule):
    """The loss of a batch whose row groups use different adapters, as one module call (see LossModule).

    One group: exactly the single-adapter loss (router aux loss included). Several: one loss per group.
    """

    # A step of some tenants leaves the other tenants' adapter weights without gradients (DDP must expect it).
    leaves_parameters_unused = True

    def __init__(self, model: torch.nn.Module, router: LoraRouter):
        super().__init__(model)
        self.router = router

    def forward(self, batch: dict[str, torch.Tensor], groups: list[RowGroup],
                router_aux_loss_coef: float | None = None) -> list[LossParts]:
        with self.router.route(groups):
            if len(groups) == 1:
                return [causal_lm_loss_sum(self.model, batch, router_aux_loss_coef)]
            if router_aux_loss_coef:
                raise ValueError(
                    f"router_aux_loss_coef={router_aux_loss_coef}: the MoE router load-balancing loss is a statistic "
                    "over all rows of a batch, so it would mix tenants; create the model with router_aux_loss_coef=0 "
                    "for mixed-tenant batches, or give each forward_backward one adapter_name.")
            return tenant_loss_sums(self.model, batch, groups)
