"""Data-parallel training over several processes (torchrun, gloo, CPU) equals training in one process.

Each strategy trains the same tiny model on the same 13 chats for 4 optimizer steps (batch_size 3, 2
micro-batches per step) through the real recipe, and is compared with the single-process run.

Tolerances (fp32): per-step loss within 1e-4 relative, final trainable weights within 1e-5 absolute.
Measured (2 cores): loss differences <= 7e-8 relative, weight differences <= 2.6e-7. The AdamW runs use
lr 1e-3 because Adam divides each gradient by its own running RMS: float summation-order noise (gloo's
sums vs one process's) in near-zero gradients reaches the weights in proportion to the learning rate.

The data makes a per-rank mean wrong: ranks hold 2 and 1 rows of each 3-row micro-batch (unequal token
counts), and step 3 contains the epoch's last, 1-row micro-batch, where one rank trains on a fully masked
row. Only the token mean over the global batch matches one process.
"""
from parallel_checks import assert_same_training, assert_sharded_in_half


def test_ddp_matches_one_process_with_full_replicas(workspace):
    run, reference = workspace.run("ddp"), workspace.run("single")
    assert run.result["strategy"] == "ddp"
    assert_same_training(run, reference)
    assert all(s["param_bytes"] == s["param_full_bytes"] for s in run.result["shares"])  # replicas, not shards


def test_native_fsdp_matches_one_process_and_shards(workspace):
    run = workspace.run("native_fsdp")
    assert run.result["strategy"] == "native_fsdp"
    assert run.result["fsdp_units"] == 3  # one unit per decoder layer (2) + the root
    assert_same_training(run, workspace.run("single"))
    assert_sharded_in_half(run)


def test_accelerate_fsdp_matches_one_process_and_shards(workspace):
    run = workspace.run("accelerate_fsdp")
    assert run.result["strategy"] == "accelerate_fsdp"
    assert run.result["fsdp_units"] >= 3  # Accelerate's layout: the layers, embeddings + output layer, the root
    assert_same_training(run, workspace.run("single"))
    assert_sharded_in_half(run)


def test_hsdp_over_two_replicas_of_two_shards_matches(workspace):
    run = workspace.run("hsdp")  # 4 processes: dp_size=2 replicas × fsdp_size=2 shards
    assert len(run.result["shares"]) == 4
    assert_same_training(run, workspace.run("single"))
    assert_sharded_in_half(run)


def test_lora_under_fsdp_trains_only_the_adapters_and_matches(workspace):
    run, reference = workspace.run("accelerate_fsdp_lora"), workspace.run("single_lora")
    assert run.result["trainable"] == reference.result["trainable"]
    assert run.result["trainable"] and all(".lora_" in name for name in run.result["trainable"])
    assert_same_training(run, reference)
    assert_sharded_in_half(run)
    # Adam keeps two moments per adapter weight only; each rank holds half of them.
    assert run.result["shares"][0]["optim_full_bytes"] == reference.result["shares"][0]["optim_bytes"]


def test_bf16_lora_under_native_fsdp_tracks_one_process(workspace):
    """bf16: FSDP gathers and computes in bf16 and reduces in fp32; one process autocasts. Not bit-equal, so
    losses are compared within 1e-3 relative (measured ~2e-5) and weights are not compared."""
    run, reference = workspace.run("native_fsdp_bf16_lora"), workspace.run("single_bf16_lora")
    assert_same_training(run, reference, loss_rtol=1e-3, weight_atol=None)


def test_moe_under_ddp_matches_one_process(workspace):
    """A tiny Qwen3.5-MoE (4 experts, top 2; DDP finds unused experts). Two settings isolate what is compared:

    - the router load-balancing loss is off, to compare the data-parallel gradients alone (with it on, each
      rank adds its share of the global micro-batch's aux loss: test_parallel_ep, router_balance.py);
    - SGD instead of AdamW: a few weights here get rounding-level gradients, which Adam scales up to
      lr-sized steps (one q_proj element differed by 8e-6 with AdamW at lr 1e-3). With SGD the weights
      show the gradients themselves: measured 7e-9 weight and 9e-8 relative loss differences.
    """
    run = workspace.run("ddp_moe")
    assert run.result["strategy"] == "ddp"
    assert_same_training(run, workspace.run("single_moe"))
