"""The training loss as one module call, whatever the objective (twinkle_core.objectives)."""
from __future__ import annotations

import torch

from twinkle_core.objectives import Objective, get_objective


class LossModule(torch.nn.Module):
    """The training loss as one module call, so parallel wrappers see the whole computation.

    `causal_lm_loss_sum` runs the decoder and the output layer separately (to skip untrained positions);
    called through this module, DDP still prepares its gradient reduction and FSDP's root unit still
    gathers the parameters it owns (embeddings, final norm, output layer) around it. The embedding
    getters let Accelerate's FSDP2 layout find the model's embedding and output layers.
    """

    def __init__(self, model: torch.nn.Module, group=None, objective: Objective | None = None,
                 options: dict | None = None):
        super().__init__()
        self.model = model
        self.group = group  # data-parallel ranks: the router aux loss (or InfoNCE's negatives) of the global batch
        self.objective = objective or get_objective("causal_lm")
        self.options = options or {}  # the objective's own (e.g. InfoNCE's temperature and pooling)

    def forward(self, batch: dict[str, torch.Tensor], router_aux_loss_coef: float | None = None,
                embed_only: bool = False):
        """The LossParts of the batch; `embed_only`: the objective's embeddings of it (cached-embedding steps)."""
        if embed_only:
            return self.objective.embed(self.model, batch, **self.options)
        return self.objective.loss_sum(self.model, batch, router_aux_loss_coef, self.group, **self.options)

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.model.get_input_embeddings()

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.model.get_output_embeddings()
