"""Multi-tenant LoRA over several processes (torchrun, gloo, CPU) equals the same run in one process.

Two tenants with their own rank, targets, learning rate, accumulation and step count train together on the
13 tiny chats through the real multi-tenant recipe: alice (r=4, all-linear, 2 micro-batches per step,
3 steps) and bob (r=2, q/v only, 1 micro-batch per step, 4 steps), so the rounds mix tenants that step at
different times and bob finishes first. Each 3-row micro-batch is dealt out 2 + 1 rows to the two ranks.

Tolerances (fp32, as test_parallel_equivalence): per-step loss within 1e-4 relative, final adapter weights
within 1e-5. Measured (2 cores): loss differences <= 6.8e-8 relative under every layout; weights 1.9e-7
(Accelerate FSDP, DDP) and 6e-8 (native FSDP, tenants one after another vs mixed batches in one process).
"""
import sys

import pytest
from safetensors.torch import load_file

from parallel_checks import assert_sharded_in_half
from twinkle_core.launch import torchrun_command
from twinkle_core.parallel import ParallelConfig
from twinkle_core.train.multi_lora_config import MultiLoraRunConfig, TenantRunConfig

LOSS_RTOL, WEIGHT_ATOL = 1e-4, 1e-5
TENANTS = {
    "alice": dict(lora_r=4, lora_alpha=8, lora_target_modules="all-linear", gradient_accumulation_steps=2,
                  max_steps=3, seed=0),
    "bob": dict(lora_r=2, lora_alpha=4, lora_target_modules=["q_proj", "v_proj"], gradient_accumulation_steps=1,
                max_steps=4, seed=5),
}
# name: (processes, mixed batches, parallel settings)
RUNS = {
    "single": (1, True, {}),
    "accelerate_fsdp": (2, True, {}),
    "native_fsdp_one_after_another": (2, False, dict(strategy="native_fsdp")),
    "ddp": (2, True, dict(dp_size=2)),
}
_done: dict = {}


def _run(workspace, name):
    if name not in _done:
        nproc, mixed, parallel = RUNS[name]
        path, family = workspace.models["llama"]
        tenants = [TenantRunConfig(name=tenant, train_data=workspace.data["llama"], lora_dropout=0.0, optimizer="AdamW",
                                   lr=1e-3, weight_decay=0.0, scheduler="ConstantWarmupScheduler", warmup_ratio=0.0,
                                   max_grad_norm=1.0, epochs=1, batch_size=3, **settings)
                   for tenant, settings in TENANTS.items()]
        config = MultiLoraRunConfig(
            model_id=str(path), model_path=path, family=family, checkpoint_dir=workspace.root / name / "checkpoints",
            mixed_precision="no", parallel=ParallelConfig(nproc_per_node=nproc, **parallel), max_loras=2, max_r=4,
            mixed_batches=mixed, tenants=tenants).write(workspace.root / f"{name}.json")
        args = [str(config), str(workspace.root / name / "out")]
        cmd = ([sys.executable, "-m", "multi_lora_worker", *args] if nproc == 1
               else torchrun_command("multi_lora_worker", args, nproc_per_node=nproc))
        _done[name] = workspace.launch([cmd], name)
    return _done[name]


def _assert_same_tenants(run, reference):
    assert run.result["failed"] == {} and set(run.result["steps"]) == set(TENANTS)
    for tenant, settings in TENANTS.items():
        got, want = run.result["steps"][tenant], reference.result["steps"][tenant]
        assert len(got) == len(want) == settings["max_steps"]
        for step, (a, b) in enumerate(zip(got, want), start=1):
            assert abs(a["loss"] - b["loss"]) <= LOSS_RTOL * abs(b["loss"]), f"{tenant} step {step}: {a} vs {b}"
            assert a["trained_tokens"] == b["trained_tokens"]
    assert set(run.weights) == set(reference.weights)
    worst = max((run.weights[k] - reference.weights[k]).abs().max().item() for k in reference.weights)
    assert worst <= WEIGHT_ATOL, f"largest weight difference {worst}"


@pytest.mark.parametrize("name", ["accelerate_fsdp", "native_fsdp_one_after_another"])
def test_tenants_under_fsdp_match_one_process_and_shard(workspace, name):
    run, reference = _run(workspace, name), _run(workspace, "single")
    assert run.result["strategy"] == name.removesuffix("_one_after_another")
    _assert_same_tenants(run, reference)
    assert_sharded_in_half(run)
    # Rank 0 saved each tenant's gathered adapter as a plain PEFT directory: the one-process adapter's weights.
    for tenant in TENANTS:
        saved = load_file(f"{run.result['checkpoints'][tenant]}/adapter_model.safetensors")
        expected = load_file(f"{reference.result['checkpoints'][tenant]}/adapter_model.safetensors")
        assert saved.keys() == expected.keys()
        assert max((saved[k] - expected[k]).abs().max().item() for k in saved) <= WEIGHT_ATOL


def test_tenants_under_ddp_match_one_process(workspace):
    run = _run(workspace, "ddp")
    assert run.result["strategy"] == "ddp"
    _assert_same_tenants(run, _run(workspace, "single"))
    assert all(s["param_bytes"] == s["param_full_bytes"] for s in run.result["shares"])
