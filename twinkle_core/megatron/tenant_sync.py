"""How one tenant's Stepper combines the processes of a megatron layout (multi-tenant LoRA on megatron).

Tenants train on plain `.grad`s with their own torch optimizers, outside megatron's DDP grad buffers (one
buffer and one optimizer for all trainable parameters would step every tenant together). What megatron's
DDP and optimizer do for a model's parameters is done here for one tenant's, at its own step:

- tensor parallelism needs nothing: the LoRA layer's communication already gives every whole adapter
  matrix its full gradient on every tp rank (twinkle_core.megatron.lora);
- pipeline stages hold different layers' adapters: nothing to exchange;
- data-parallel ranks saw different rows: their gradients are summed (a rank without rows of the tenant
  adds zeros), as are the summed losses and token counts;
- the gradient norm for clipping is taken over the model-parallel group (tp × pp), counting a matrix that
  every tp rank holds whole once, as megatron's optimizer does.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


class MegatronTenantSync:
    """The `parallel` of a tenant's Stepper under megatron's process groups."""

    grad_average_size = 1  # gradients are summed over data-parallel ranks, then divided by global tokens

    def all_reduce_sum(self, values: list[float]) -> list[float]:
        from megatron.core import parallel_state as ps

        if ps.get_data_parallel_world_size() == 1:
            return list(values)
        tensor = torch.tensor([float(v) for v in values], dtype=torch.float64)
        dist.all_reduce(tensor, group=ps.get_data_parallel_group())
        return tensor.tolist()

    def clip_grad_norm_(self, parameters: list[torch.nn.Parameter], max_norm: float) -> float:
        """Sum the gradients over data-parallel ranks, then clip them to `max_norm`; returns the norm."""
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

        if ps.get_data_parallel_world_size() > 1:
            for param in parameters:
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
                dist.all_reduce(param.grad, group=ps.get_data_parallel_group())
        grads = [p.grad for p in parameters if p.grad is not None]
        counted = [p.grad for p in parameters if p.grad is not None and param_is_not_tensor_parallel_duplicate(p)]
        squares = torch.stack([g.float().pow(2).sum() for g in counted]).sum() if counted else torch.zeros(())
        if dist.is_initialized() and dist.get_world_size(ps.get_model_parallel_group()) > 1:
            dist.all_reduce(squares, group=ps.get_model_parallel_group())
        norm = float(squares.sqrt())
        coefficient = max_norm / (norm + 1e-6)  # megatron's (and torch's) clipping rule
        if coefficient < 1.0 and grads:
            torch._foreach_mul_(grads, coefficient)
        return norm
