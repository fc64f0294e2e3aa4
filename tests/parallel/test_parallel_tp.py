"""Tensor parallelism trains like one process: TP=2, LoRA under TP=2, FSDP × TP (2 × 2), fp16 loss scaling.

The tiny Llama (4 attention heads, 2 kv heads, hidden 32, intermediate 64, vocabulary 384, tied
embeddings) loads whole and is sharded with its Transformers tp plan over the mesh's `tp` dim (gloo, CPU);
the tp ranks of one data-parallel rank see the same batch. Tolerances as in test_parallel_equivalence
(fp32): loss 1e-4 relative, weights 1e-5 absolute; checkpoints, gathered to full tensors on rank 0, reload
in one process with the logits of the one-process run within 1e-5.
Measured (2 cores): TP=2 loss differences 0 .. 4e-8 relative, weights <= 6.4e-7; LoRA under TP=2 loss
<= 3.6e-8 relative, adapter weights <= 1.4e-7; FSDP × TP and DP × TP (4 processes) loss <= 1.4e-8
relative, weights <= 7.8e-7.
"""
import json

import pytest

from parallel_checks import assert_same_training
from test_parallel_checkpoints import LOGITS_ATOL, _logits, _reload
from twinkle_core.launch import run_streaming, torchrun_command

LAYER = "model.layers.0."


def test_tp_matches_one_process(workspace):
    run = workspace.run("tp")
    assert run.result["strategy"] == "tp"
    assert_same_training(run, workspace.run("single"))
    assert run.result["replicated_spread"] == 0.0  # norms: equal gradients on both tp ranks


def test_tp_shards_each_projection_in_half_along_its_dim(workspace):
    shapes = workspace.run("tp").result["local_shapes"]
    assert len(shapes) == 2
    for rank_shapes in shapes:
        # column-wise: output features split (dim 0); row-wise: input features split (dim 1)
        assert rank_shapes[LAYER + "self_attn.q_proj.weight"] == [[16, 32], [32, 32]]
        assert rank_shapes[LAYER + "self_attn.k_proj.weight"] == [[8, 32], [16, 32]]
        assert rank_shapes[LAYER + "self_attn.o_proj.weight"] == [[32, 16], [32, 32]]
        assert rank_shapes[LAYER + "mlp.gate_proj.weight"] == [[32, 32], [64, 32]]
        assert rank_shapes[LAYER + "mlp.down_proj.weight"] == [[32, 32], [32, 64]]
        assert rank_shapes["model.embed_tokens.weight"] == [[192, 32], [384, 32]]  # vocabulary split (tied lm_head)
        assert rank_shapes[LAYER + "input_layernorm.weight"] == [[32], [32]]  # replicated


def test_tp_checkpoint_reloads_in_one_process(workspace):
    run, reference = workspace.run("tp"), workspace.run("single")
    model = _reload(workspace, run)
    assert (_logits(model) - _logits(_reload(workspace, reference))).abs().max().item() <= LOGITS_ATOL


def test_tp_grad_norm_counts_sharded_and_replicated_weights_once(workspace):
    run, reference = workspace.run("tp"), workspace.run("single")
    for got, want in zip(run.result["steps"], reference.result["steps"]):
        assert abs(got["grad_norm"] - want["grad_norm"]) <= 1e-4 * want["grad_norm"]


def test_lora_under_tp_matches_one_process(workspace):
    run, reference = workspace.run("tp_lora"), workspace.run("single_lora")
    assert run.result["strategy"] == "tp"
    assert run.result["trainable"] == reference.result["trainable"]
    assert run.result["trainable"] and all(".lora_" in name for name in run.result["trainable"])
    assert_same_training(run, reference)
    # the whole lora_A of column-wise and lora_B of row-wise layers got equal gradients on both tp ranks
    assert run.result["replicated_spread"] == 0.0


def test_lora_under_tp_shards_the_adapter_with_its_base_layer(workspace):
    lora = "base_model.model." + LAYER
    for rank_shapes in workspace.run("tp_lora").result["local_shapes"]:
        # column-wise base (q_proj, gate_proj): lora_A whole, lora_B split along the output features like the base
        assert rank_shapes[lora + "self_attn.q_proj.base_layer.weight"] == [[16, 32], [32, 32]]
        assert rank_shapes[lora + "self_attn.q_proj.lora_A.default.weight"] == [[4, 32], [4, 32]]
        assert rank_shapes[lora + "self_attn.q_proj.lora_B.default.weight"] == [[16, 4], [32, 4]]
        assert rank_shapes[lora + "mlp.gate_proj.lora_B.default.weight"] == [[32, 4], [64, 4]]
        # row-wise base (o_proj, down_proj): lora_A split along the input features like the base, lora_B whole
        assert rank_shapes[lora + "self_attn.o_proj.base_layer.weight"] == [[32, 16], [32, 32]]
        assert rank_shapes[lora + "self_attn.o_proj.lora_A.default.weight"] == [[4, 16], [4, 32]]
        assert rank_shapes[lora + "self_attn.o_proj.lora_B.default.weight"] == [[32, 4], [32, 4]]
        assert rank_shapes[lora + "mlp.down_proj.lora_A.default.weight"] == [[4, 32], [4, 64]]


def test_lora_under_tp_adapter_reloads_in_one_process(workspace):
    run, reference = workspace.run("tp_lora"), workspace.run("single_lora")
    model = _reload(workspace, run)
    assert model.adapter_name is not None
    assert (_logits(model) - _logits(_reload(workspace, reference))).abs().max().item() <= LOGITS_ATOL


def test_fsdp_x_tp_matches_one_process(workspace):
    run = workspace.run("fsdp_tp")  # 4 processes: fsdp_size=2 × tp_size=2, sharded by fully_shard
    assert run.result["strategy"] == "fsdp_tp"
    assert run.result["fsdp_units"] == 3  # one unit per decoder layer (2) + the root
    assert_same_training(run, workspace.run("single"))


def test_fsdp_x_tp_splits_projections_four_ways_and_the_rest_two_ways(workspace):
    run = workspace.run("fsdp_tp")
    for rank_shapes in run.result["local_shapes"]:
        # tp splits q_proj's output features, FSDP splits the tp shard again along dim 0
        assert rank_shapes[LAYER + "self_attn.q_proj.weight"] == [[8, 32], [32, 32]]
        assert rank_shapes[LAYER + "self_attn.o_proj.weight"] == [[16, 16], [32, 32]]
        assert rank_shapes[LAYER + "mlp.down_proj.weight"] == [[16, 32], [32, 64]]
        assert rank_shapes["model.embed_tokens.weight"] == [[96, 32], [384, 32]]
        assert rank_shapes[LAYER + "input_layernorm.weight"] == [[16], [32]]  # FSDP only
    for share in run.result["shares"]:  # 1/4, but the 5 norms (160 of 30,880 values) are only halved: 0.2513
        assert share["param_bytes"] / share["param_full_bytes"] == pytest.approx(0.25, abs=0.002)
        assert share["optim_bytes"] / share["optim_full_bytes"] == pytest.approx(0.25, abs=0.002)


def test_dp_x_tp_matches_one_process_with_replicated_tp_shards(workspace):
    """dp_size=2 × tp_size=2: fully_shard in HSDP mode with shard groups of 1 keeps whole replicas of the tp shards
    (and all-reduces their gradients over dp)."""
    run = workspace.run("dp_tp")
    assert run.result["strategy"] == "fsdp_tp"
    assert_same_training(run, workspace.run("single"))
    for rank_shapes in run.result["local_shapes"]:
        assert rank_shapes[LAYER + "self_attn.q_proj.weight"] == [[16, 32], [32, 32]]
        assert rank_shapes[LAYER + "input_layernorm.weight"] == [[32], [32]]
    for share in run.result["shares"]:  # half of everything but the norms, which every rank holds whole
        assert share["param_bytes"] / share["param_full_bytes"] == pytest.approx(0.5, abs=0.005)


def test_qwen3_5_under_tp_sums_the_per_head_norm_gradients_and_matches(workspace):
    """Qwen3.5's plan: q/k norms (one weight over the heads, `replicated_with_grad_allreduce`) get gradients from
    each rank's own heads, summed over the tp ranks; its linear-attention projections gather their outputs.

    SGD (lr 0.1) rather than AdamW: Adam's per-element normalisation blows rounding-level gradients up to
    lr-sized steps (with AdamW one gate_proj element differed by 1.1e-5, all others <= 8e-8), and it would
    also hide a gradient that is off by a constant factor. Measured with SGD: weights <= 1.2e-8, losses
    <= 7e-8 relative; without the summed norm gradients the q/k norms end 2.7e-4 away from one process.
    """
    run = workspace.run("tp_qwen3_5")
    assert_same_training(run, workspace.run("single_qwen3_5"))
    assert run.result["replicated_spread"] == 0.0
    shapes = run.result["local_shapes"][0]
    assert shapes["model.layers.1.self_attn.q_norm.weight"] == [[32], [32]]  # whole
    assert shapes["model.layers.1.self_attn.k_proj.weight"] == [[32, 64], [64, 64]]  # 1 of 2 kv heads of 32
    assert shapes["model.layers.0.linear_attn.out_proj.weight"][0][0] * 2 == shapes[
        "model.layers.0.linear_attn.out_proj.weight"][1][0]


def test_fp16_loss_scaler_skips_the_step_on_every_rank_when_one_tp_shard_overflows(workspace):
    out = workspace.root / "tp_scaler"
    run_streaming(torchrun_command("scaler_worker", [str(out)], nproc_per_node=2), lambda line: None,
                  timeout_s=120, env=workspace.env())
    for rank in range(2):
        record = json.loads((out / f"rank{rank}.json").read_text())
        assert record["stepped"] == [[False, False], [True, True]]  # step 1 skipped (rank 1's inf), step 2 taken
        assert record["scale"] == [512.0, 512.0]  # halved once from 1024 after the overflow
