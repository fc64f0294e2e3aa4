"""Pure tensor parallelism (tp_size=2, 2 processes, gloo, CPU) trains like one process.

The tiny Llama (4 attention heads, 2 kv heads, hidden 32, intermediate 64) is loaded with Transformers' tp
plan over the mesh's `tp` dim; both ranks see the same batch (the data-parallel group has size 1), so the
token counts are those of one process. Tolerances as in test_parallel_equivalence (fp32): loss 1e-4
relative, weights 1e-5 absolute; the checkpoint, gathered with DTensor.full_tensor on rank 0, reloads in
one process with the logits of the one-process run within 1e-5.
"""
from parallel_checks import assert_same_training
from test_parallel_checkpoints import LOGITS_ATOL, _logits, _reload


def test_tp_matches_one_process(workspace):
    run = workspace.run("tp")
    assert run.result["strategy"] == "tp"
    assert_same_training(run, workspace.run("single"))


def test_tp_shards_each_projection_in_half_along_its_dim(workspace):
    shapes = workspace.run("tp").result["local_shapes"]
    assert len(shapes) == 2
    prefix = "model.layers.0."
    for rank_shapes in shapes:
        # column-wise: output features split (dim 0); row-wise: input features split (dim 1)
        assert rank_shapes[prefix + "self_attn.q_proj.weight"] == [[16, 32], [32, 32]]
        assert rank_shapes[prefix + "self_attn.k_proj.weight"] == [[8, 32], [16, 32]]
        assert rank_shapes[prefix + "self_attn.o_proj.weight"] == [[32, 16], [32, 32]]
        assert rank_shapes[prefix + "mlp.gate_proj.weight"] == [[32, 32], [64, 32]]
        assert rank_shapes[prefix + "mlp.down_proj.weight"] == [[32, 32], [32, 64]]
        assert rank_shapes[prefix + "input_layernorm.weight"] == [[32], [32]]  # replicated


def test_tp_checkpoint_reloads_in_one_process(workspace):
    run, reference = workspace.run("tp"), workspace.run("single")
    model = _reload(workspace, run)
    assert (_logits(model) - _logits(_reload(workspace, reference))).abs().max().item() <= LOGITS_ATOL


def test_tp_grad_norm_counts_sharded_and_replicated_weights_once(workspace):
    run, reference = workspace.run("tp"), workspace.run("single")
    for got, want in zip(run.result["steps"], reference.result["steps"]):
        assert abs(got["grad_norm"] - want["grad_norm"]) <= 1e-4 * want["grad_norm"]


def test_lora_under_tp_is_refused_with_the_alternative(workspace):
    from twinkle_core.launch import WorkerError, run_streaming, torchrun_command
    import pytest

    config = workspace.write_config("tp_lora", use_lora=True, parallel=dict(nproc_per_node=2, tp_size=2))
    cmd = torchrun_command("train_worker", [str(config), str(workspace.root / "tp_lora")], nproc_per_node=2)
    with pytest.raises(WorkerError) as err:
        run_streaming(cmd, lambda line: None, timeout_s=120, env=workspace.env())
    assert "LoRA under tensor parallelism (tp_size > 1) arrives in a later release" in str(err.value)
