"""MultiLoraMegatronModel: isolated tenants on one megatron-core base, equal to training each adapter alone.

One worker run per case (tests/megatron/multi_lora_megatron_worker.py) on a tiny Llama, fp32, 3 AdamW steps:
two tenants with different ranks, targets, learning rates and seeds, each on its own fixed batches of 8
rows in micro-batches of 2. "single" trains the first tenant alone on MegatronModel (megatron's DDP and
optimizer); the multi-tenant runs train both, one batch per tenant ("multi") or one mixed batch per step.
"""
from __future__ import annotations


import pytest
import torch
from safetensors.torch import load_file

from megatron_worker import global_batch
from test_megatron_model import _hf_loss, assert_close, run_workers
from tiny_models import save_tiny_model

TENANTS = [{"name": "alice", "r": 4, "alpha": 8, "lr": 1e-2, "seed": 1},
           {"name": "bob", "r": 2, "alpha": 4, "targets": ["q_proj", "k_proj", "v_proj", "o_proj"], "lr": 2e-2,
            "seed": 2}]
RUNS = {  # name: (layout, processes, extra job keys)
    "checks": ({}, 1, {"checks": True}),
    "single": ({}, 1, {"single": True, "export": True}),
    "multi": ({}, 1, {"export": True}),
    "mixed": ({}, 1, {"mixed": True}),
    "multi_accum": ({}, 1, {"accumulation": {"bob": 2}}),
    "mixed_tp2": ({"tp": 2}, 2, {"mixed": True, "export": True}),
    "mixed_tp2_sp": ({"tp": 2, "sequence_parallel": True}, 2, {"mixed": True}),
    "mixed_pp2": ({"pp": 2}, 2, {"mixed": True}),
    "mixed_dp2": ({}, 2, {"mixed": True}),
}


@pytest.fixture(scope="session")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("multi_lora_megatron")
    model = save_tiny_model(root / "dense", "llama", tie_word_embeddings=False)
    results = {"root": root, "model": model}
    by_size: dict[int, dict[str, dict]] = {}  # one process tree per world size runs all of its cases
    for name, (layout, nproc, extra) in RUNS.items():
        by_size.setdefault(nproc, {})[name] = {"model": str(model), "layout": layout, "steps": 3, "micro_batch_size": 2,
                                               "tenants": TENANTS, "out": str(root / "out" / name), **extra}
    for nproc, jobs in by_size.items():
        results.update(run_workers(jobs, nproc, root, module="multi_lora_megatron_worker"))
    return results


def test_a_step_of_one_tenant_changes_no_other_tenant_and_not_the_base(runs):
    checks = runs["checks"]
    assert checks["stepped"] and checks["first_changed"]
    assert checks["others_unchanged"]  # weights and optimizer state bit-identical
    assert checks["base_unchanged"]


def test_a_mixed_batch_gives_the_per_tenant_losses_and_gradients_of_separate_batches(runs):
    checks = runs["checks"]
    for name, loss in checks["separate_losses"].items():
        assert abs(checks["mixed_losses"][name] - loss) <= 1e-6 * loss
    assert checks["grad_scale"] > 0.1  # real gradients (the adapters' B left zero after a first step)
    assert checks["grad_diff"] <= 1e-5 * checks["grad_scale"]


def test_refused_adapters_change_nothing_and_a_removed_slot_is_free_again(runs):
    refusals = runs["checks"]["refusals"]
    assert "exceeds max_r=4" in refusals["errors"]["rank"]
    assert "max_loras=3" in refusals["errors"]["slots"]
    assert "already on this model" in refusals["errors"]["name"]
    assert "adapted together" in refusals["errors"]["targets"]
    assert refusals["unchanged"]
    assert refusals["adapters"] == ["alice", "bob", "after_remove"]
    assert refusals["parameter_owners"] == ["after_remove", "alice", "bob"]  # the refused ones left nothing


@pytest.mark.parametrize("name", ["multi", "mixed"])
def test_each_tenant_trains_like_its_adapter_alone_on_megatron_model(runs, name):
    assert_close(runs[name]["losses"]["alice"], runs["single"]["losses"]["alice"], rel=1e-5)
    assert runs[name]["losses"]["alice"][-1] < runs[name]["losses"]["alice"][0]
    alone = load_file(runs["root"] / "out" / "single" / "alice" / "adapter_model.safetensors")
    if name == "multi":
        among = load_file(runs["root"] / "out" / "multi" / "alice" / "adapter_model.safetensors")
        assert among.keys() == alone.keys()
        for key in alone:
            torch.testing.assert_close(among[key], alone[key], rtol=0, atol=1e-5)


def test_mixed_batches_train_like_one_tenant_after_another(runs):
    for tenant in ("alice", "bob"):
        assert_close(runs["mixed"]["losses"][tenant], runs["multi"]["losses"][tenant], rel=1e-6)


def test_a_tenant_accumulating_over_calls_steps_like_one_call_and_alone(runs):
    # bob trains each batch in 2 calls and steps after the second: the same update as one call
    assert_close(runs["multi_accum"]["losses"]["bob"], runs["multi"]["losses"]["bob"], rel=1e-6)
    assert runs["multi_accum"]["losses"]["alice"] == runs["multi"]["losses"]["alice"]


@pytest.mark.parametrize("name", ["mixed_tp2", "mixed_tp2_sp", "mixed_pp2", "mixed_dp2"])
def test_parallel_layouts_match_one_process(runs, name):
    for tenant in ("alice", "bob"):
        assert_close(runs[name]["losses"][tenant], runs["mixed"]["losses"][tenant], rel=1e-4)
        assert_close([runs[name]["held_out"][tenant]], [runs["mixed"]["held_out"][tenant]], rel=1e-4)


def test_saved_adapters_load_into_plain_peft_and_back(runs):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    one = load_file(runs["root"] / "out" / "multi" / "bob" / "adapter_model.safetensors")
    two = load_file(runs["root"] / "out" / "mixed_tp2" / "bob" / "adapter_model.safetensors")
    assert one.keys() == two.keys() and not any("gate_proj" in key for key in one)  # bob's own targets
    for key in one:  # Adam turns ~1e-7 gradient differences into ~1e-5 on near-zero entries
        torch.testing.assert_close(two[key], one[key], rtol=1e-3, atol=1e-5)
    for index, tenant in enumerate(("alice", "bob")):
        base = AutoModelForCausalLM.from_pretrained(runs["model"], dtype=torch.float32)
        model = PeftModel.from_pretrained(base, runs["root"] / "out" / "mixed_tp2" / tenant)
        loss = _hf_loss(model, global_batch(100 * index + 999, base.config.vocab_size))
        assert abs(loss - runs["mixed_tp2"]["held_out"][tenant]) <= 1e-5 * loss
    # and loaded back into a multi-tenant model (tp=2 here), the adapter gives the same held-out loss
    assert abs(runs["mixed_tp2"]["reloaded_held_out"] - runs["mixed_tp2"]["held_out"]["alice"]) <= 1e-6
