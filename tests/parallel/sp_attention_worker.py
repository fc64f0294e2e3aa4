"""Test worker: Ulysses attention over 2 ranks against SDPA over the whole sequence in one process.

    python -m torch.distributed.run --standalone --nproc-per-node 2 -m sp_attention_worker OUT.json

Each rank feeds its slice of random q/k/v (every head) to `ulysses_attention`; the outputs and the gradients
of q/k/v must equal the slices of one full SDPA's. Cases: kv heads that sp divides (grouped-query), kv heads
it does not divide (1 kv head: repeated first), and a packed batch's whole-sequence block-causal mask.
Rank 0 writes the largest differences and the shapes each rank saw.
"""
from __future__ import annotations

import json
import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn.functional as F

from twinkle_core.parallel.sequence import _block_causal, heads_to_sequence, sequence_to_heads, ulysses_attention
from twinkle_core.parallel.process_group import close_distributed
from twinkle_core.entry import finish_worker


def reference(q, k, v, mask):
    k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None).transpose(1, 2)


def compare(kv_heads: int, packed: bool, group) -> dict:
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    gen = torch.Generator().manual_seed(kv_heads)
    batch, heads, length, dim = 2, 4, 8, 8
    q = torch.randn(batch, heads, length, dim, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(batch, kv_heads, length, dim, generator=gen, dtype=torch.float64) for _ in range(2))
    weight = torch.randn(batch, length, heads, dim, generator=gen, dtype=torch.float64)
    mask = _block_causal(torch.tensor([[0, 1, 2, 0, 1, 2, 3, 0]] * batch)) if packed else None
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    want = reference(*full, mask)
    (want * weight).sum().backward()
    part = slice(rank * length // world, (rank + 1) * length // world)
    mine = [t[:, :, part].clone().requires_grad_() for t in (q, k, v)]
    got, _ = ulysses_attention(SimpleNamespace(is_causal=True), *mine, mask, group=group)
    (got * weight[:, part]).sum().backward()
    diffs = [(got - want[:, part]).abs().max().item()]
    diffs += [(m.grad - f.grad[:, :, part]).abs().max().item() for m, f in zip(mine, full)]
    return {"max_diff": max(diffs), "local_shape": list(got.shape)}


def main(out_path: str) -> None:
    dist.init_process_group("gloo")
    group = dist.group.WORLD
    x = torch.arange(2 * 4 * 4 * 3, dtype=torch.float64).reshape(2, 4, 4, 3) + 1000 * dist.get_rank()
    round_trip = (heads_to_sequence(sequence_to_heads(x, group), group) - x).abs().max().item()
    results = {"round_trip": round_trip, "heads_shape": list(sequence_to_heads(x, group).shape),
               "gqa": compare(2, False, group), "kv_repeat": compare(1, False, group),
               "packed": compare(2, True, group)}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, results)
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(gathered, f)
    close_distributed()


if __name__ == "__main__":
    finish_worker(main(sys.argv[1]))
