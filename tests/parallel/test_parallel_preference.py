"""DPO across data-parallel ranks equals one process: pairs stay whole on a rank, losses and rewards are
summed over pairs and divided by the step's global pair count.

Each run trains a LoRA adapter on a tiny Llama (fp32, SGD) for 3 steps of 2 micro-batches of 3 pairs;
the reference is the base with the adapter disabled. Per-step loss, log-probs and the adapter weights after
3 steps agree with one process within 1e-5 relative (the weights as one vector). The rewards are
beta * (log-prob - reference log-prob), a difference of two sums of ~|50| in fp32: their summation order
moves them by ~1e-6 absolute, so they are held to 1e-5 of the log-probs they come from (beta * |logps|).
"""
from __future__ import annotations

import pytest
import torch

REL = 1e-5
BETA = 0.5  # conftest's DPO settings


@pytest.mark.parametrize("name", ["ddp_dpo", "native_fsdp_dpo", "accelerate_fsdp_dpo"])
def test_two_processes_equal_one(workspace, name):
    run, reference = workspace.run(name), workspace.run("single_dpo")
    assert len(reference.losses) == 3 and reference.losses[-1] < reference.losses[0]
    assert [s["trained_tokens"] for s in run.result["steps"]] == [6, 6, 6]  # pairs per step
    for step, (got, want) in enumerate(zip(run.result["steps"], reference.result["steps"]), start=1):
        for key in ("loss", "logps/chosen", "logps/rejected"):
            assert abs(got[key] - want[key]) <= REL * abs(want[key]), f"step {step} {key}"
        scale = BETA * max(abs(want["logps/chosen"]), abs(want["logps/rejected"]))
        for key in ("rewards/margin", "rewards/chosen", "rewards/rejected"):
            assert abs(got[key] - want[key]) <= REL * max(abs(want[key]), scale), f"step {step} {key}"
        assert got["rewards/accuracy"] == want["rewards/accuracy"]
    names = sorted(reference.weights)
    assert names == sorted(run.weights) and any("lora_B" in n for n in names)
    ours, theirs = (torch.cat([w[k].reshape(-1) for k in names]) for w in (run.weights, reference.weights))
    assert float((ours - theirs).norm() / theirs.norm()) <= REL
