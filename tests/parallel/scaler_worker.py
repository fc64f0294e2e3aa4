"""Worker for the fp16 loss-scaler check under tensor parallelism (2 processes, tp_size=2).

    python -m torch.distributed.run --standalone --nproc-per-node 2 -m scaler_worker OUT

A column-wise sharded linear layer (a DTensor weight, its output gathered) and a whole weight train with fp16 loss scaling.
Step 1 puts an inf into rank 1's gradient shard only; step 2 is clean. Each rank writes OUT/rank<r>.json:
whether it stepped each time (its weights changed) and the scale after each step.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

from twinkle_core.parallel import DeviceMesh
from twinkle_core.parallel.tp import TensorParallelGradScaler
from twinkle_core.parallel.process_group import close_distributed
from twinkle_core.entry import finish_worker


def main(out_dir: str) -> None:
    mesh = DeviceMesh.from_sizes(tp_size=2)
    torch.manual_seed(0)
    layer = parallelize_module(torch.nn.Linear(4, 4, bias=False), mesh["tp"],
                               ColwiseParallel(output_layouts=Replicate()))
    whole = torch.nn.Parameter(torch.ones(4))
    params = [layer.weight, whole]
    optimizer = torch.optim.SGD(params, lr=0.1)
    scaler = TensorParallelGradScaler(device="cpu", init_scale=1024.0)
    record = {"stepped": [], "scale": []}
    for step in range(2):
        before = [layer.weight.to_local().clone(), whole.detach().clone()]
        loss = (layer(torch.ones(2, 4)) * whole).sum()
        scaler.scale(loss).backward()
        if step == 0 and dist.get_rank() == 1:
            layer.weight.grad.to_local()[0, 0] = float("inf")  # an overflow only this rank can see
        scaler.unscale_(optimizer)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        after = [layer.weight.to_local(), whole.detach()]
        record["stepped"].append([not torch.equal(b, a) for b, a in zip(before, after)])
        record["scale"].append(float(scaler.get_scale()))
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    (Path(out_dir) / f"rank{dist.get_rank()}.json").write_text(json.dumps(record))
    close_distributed()


if __name__ == "__main__":
    finish_worker(main(sys.argv[1]))
