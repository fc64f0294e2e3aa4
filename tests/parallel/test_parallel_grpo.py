"""GRPO across data-parallel ranks (DDP, native FSDP) equals one process on the same completions: each
prompt's group is sampled, scored and normalised on one rank, and the loss is summed per completion and
divided by the step's global count of completions. Under FSDP the old log-probs are computed on weights
gathered once per rollout (twinkle_core.parallel.fsdp.whole_weights), as the sampling is.

Both runs train a LoRA adapter on a tiny Llama (fp32, SGD) for 3 rollouts of 3 prompts x 4 fixed
completions (train_worker.FixedSampler), 2 optimizer steps each, with the k3 KL to the base. Per-step KL
and rewards, and the adapter weights after 6 steps agree with one process within 1e-5 relative. The loss is
a mean of ratio x advantage terms of size ~1 whose advantages cancel within each group (it stays near 0):
it is held to 1e-5 of that size (absolute 1e-5), as a relative bound on a cancelled sum would be noise.
"""
from __future__ import annotations

import pytest
import torch

REL = 1e-5


@pytest.mark.parametrize("name, strategy", [("ddp_grpo", "ddp"), ("native_fsdp_grpo", "native_fsdp")])
def test_two_processes_equal_one_on_fixed_completions(workspace, name, strategy):
    run, reference = workspace.run(name), workspace.run("single_grpo")
    assert run.result["strategy"] == strategy and len(reference.result["steps"]) == 6
    assert [s["trained_tokens"] for s in run.result["steps"]] == [12] * 6  # completions per step, both ranks
    for got, want in zip(run.result["steps"], reference.result["steps"]):
        assert abs(got["loss"] - want["loss"]) <= REL * max(abs(want["loss"]), 1.0), got["step"]
        for key in ("kl", "reward", "reward_std", "completion_length"):
            assert abs(got[key] - want[key]) <= REL * max(abs(want[key]), 1e-6), (got["step"], key)
    assert any(s["kl"] > 0 for s in reference.result["steps"])  # the adapter moved away from the base
    assert any(s["clip_fraction"] > 0 or abs(s["loss"]) > 1e-6 for s in reference.result["steps"])
    names = sorted(reference.weights)
    assert names == sorted(run.weights) and any("lora_B" in n for n in names)
    ours, theirs = (torch.cat([w[k].reshape(-1) for k in names]) for w in (run.weights, reference.weights))
    assert float((ours - theirs).norm() / theirs.norm()) <= REL


def test_sampling_under_fsdp_gathers_the_weights_once_per_rollout_and_trains(workspace):
    """The policy's own generate under Accelerate's FSDP (the default strategy): every rank samples its
    prompts with the whole model gathered once (per-token gathers from ranks that stop at different lengths
    would hang), then trains sharded. Ranks sample with different seeds."""
    run = workspace.run("accelerate_fsdp_grpo_sampled")
    assert run.result["strategy"] == "accelerate_fsdp" and run.result["fsdp_units"] > 1
    steps = run.result["steps"]
    assert len(steps) == 4 and all(s["trained_tokens"] == 12 for s in steps)
    assert all(0 < s["completion_length"] <= 8 for s in steps)  # max_new_tokens=8
    assert all(torch.isfinite(torch.tensor([s["loss"], s["kl"]])).all() for s in steps)
    assert steps[1]["kl"] > 0  # the second pass of a rollout trains on moved weights
