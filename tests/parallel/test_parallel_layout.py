"""Layouts are checked before any process starts, with errors that name the option and what would work."""

import pytest
from transformers import AutoConfig

from twinkle_core.launch import WorkerError, run_streaming, torchrun_command
from twinkle_core.parallel import ParallelConfig, check_parallel_config, local_rows, validate_mesh_sizes


@pytest.fixture(scope="module")
def llama_config(workspace):
    return AutoConfig.from_pretrained(workspace.models["llama"][0])  # 4 heads, 2 kv heads


@pytest.fixture(scope="module")
def moe_config(workspace):
    return AutoConfig.from_pretrained(workspace.models["moe"][0])  # 4 experts


def test_sizes_must_multiply_to_the_world_size():
    with pytest.raises(ValueError) as err:
        validate_mesh_sizes({"dp_size": 2, "fsdp_size": 2}, world_size=2)
    assert "dp_size=2 × fsdp_size=2 × sp_size=1 × tp_size=1 = 4" in str(err.value)
    assert "2 processes" in str(err.value) and "dp_size=1 or fsdp_size=1 would fit" in str(err.value)


def test_tp_must_divide_the_heads_and_kv_heads(llama_config):
    with pytest.raises(ValueError, match=r"tp_size=4 must divide num_attention_heads=4 and num_key_value_heads=2; "
                                         r"tp_size can be one of \[1, 2\]"):
        validate_mesh_sizes({"tp_size": 4}, world_size=4, model_config=llama_config)


def test_sp_must_divide_the_heads(llama_config):
    with pytest.raises(ValueError, match=r"sp_size=3 must divide num_attention_heads=4.*one of \[1, 2, 4\]"):
        validate_mesh_sizes({"sp_size": 3}, world_size=3, model_config=llama_config)


def test_ep_needs_experts_that_it_divides(llama_config, moe_config):
    with pytest.raises(ValueError, match=r"ep_size=2: model_type 'llama' has no experts"):
        validate_mesh_sizes({"fsdp_size": 2, "ep_size": 2}, world_size=2, model_config=llama_config)
    with pytest.raises(ValueError, match=r"ep_size=8 must divide the number of experts \(4\).*\[1, 2, 4\]"):
        validate_mesh_sizes({"fsdp_size": 8, "ep_size": 8}, world_size=8, model_config=moe_config)
    with pytest.raises(ValueError, match=r"ep_size=4 must divide dp_size × fsdp_size = 2"):
        validate_mesh_sizes({"fsdp_size": 2, "tp_size": 2, "ep_size": 4}, world_size=4)
    assert validate_mesh_sizes({"fsdp_size": 2, "ep_size": 2}, 2, moe_config)["ep_size"] == 2


def test_every_problem_is_reported_at_once(llama_config):
    with pytest.raises(ValueError) as err:
        validate_mesh_sizes({"tp_size": 3, "sp_size": 3}, world_size=4, model_config=llama_config)
    message = str(err.value)
    assert "= 9, but the run has 4 processes" in message and "tp_size=3" in message and "sp_size=3" in message


def test_fsdp_takes_the_ranks_left_and_dp_alone_means_ddp():
    assert ParallelConfig(nproc_per_node=2).mesh_sizes()["fsdp_size"] == 2
    assert ParallelConfig(nproc_per_node=2, dp_size=2).mesh_sizes()["fsdp_size"] == 1
    multi = ParallelConfig(nproc_per_node=2, nnodes=2, rdzv_endpoint="10.0.0.1:29500", dp_size=2)
    assert multi.mesh_sizes() == dict(dp_size=2, fsdp_size=2, tp_size=1, ep_size=1, sp_size=1)


def test_strategies_that_do_not_exist_yet_say_so(llama_config):
    assert check_parallel_config(ParallelConfig(nproc_per_node=2, tp_size=2), llama_config)["tp_size"] == 2  # pure TP
    fsdp_x_tp = check_parallel_config(ParallelConfig(nproc_per_node=4, tp_size=2), llama_config)
    assert (fsdp_x_tp["fsdp_size"], fsdp_x_tp["tp_size"]) == (2, 2)  # the ranks tp leaves are FSDP
    with pytest.raises(ValueError, match=r"pp_size=2: pipeline parallelism arrives with the Megatron backend"):
        check_parallel_config(ParallelConfig(nproc_per_node=2, pp_size=2, fsdp_size=2))
    assert check_parallel_config(ParallelConfig(nproc_per_node=2), llama_config)["fsdp_size"] == 2


def test_each_rank_takes_its_rows_of_the_global_micro_batch():
    rows = [{"input_ids": [i, i], "labels": [i, i]} for i in range(5)]
    assert [r["input_ids"][0] for r in local_rows(rows, 0, 2)] == [0, 2, 4]
    assert [r["input_ids"][0] for r in local_rows(rows, 1, 2)] == [1, 3]
    empty_share = local_rows(rows[:1], 1, 2)  # the epoch's last, short micro-batch
    assert empty_share == [{"input_ids": [0, 0], "labels": [-100, -100]}]  # runs, trains nothing


def test_a_worker_launched_with_a_wrong_layout_fails_with_the_fix(workspace):
    config = workspace.write_config("wrong_layout", parallel=dict(nproc_per_node=2, dp_size=3))
    cmd = torchrun_command("train_worker", [str(config), str(workspace.root / "wrong_layout")], nproc_per_node=2)
    with pytest.raises(WorkerError) as err:
        run_streaming(cmd, lambda line: None, timeout_s=120, env=workspace.env())
    assert "dp_size=3 × fsdp_size=1" in str(err.value) and "dp_size=2 would fit" in str(err.value)


def test_tp_with_sequence_or_expert_parallelism_is_refused_with_the_alternative(llama_config):
    with pytest.raises(ValueError) as err:
        check_parallel_config(ParallelConfig(nproc_per_node=4, tp_size=2, sp_size=2), llama_config)
    assert ("tp_size=2 with sp_size=2: tensor parallelism combined with sequence parallelism is not supported yet; "
            "use sp_size=1 (TP composes with dp_size/fsdp_size) or tp_size=1.") in str(err.value)
    with pytest.raises(ValueError, match=r"tp_size=2 with ep_size=2: tensor parallelism combined with expert "
                                         r"parallelism is not supported yet"):
        check_parallel_config(ParallelConfig(nproc_per_node=4, tp_size=2, ep_size=2))


def test_tp_of_a_model_whose_plan_has_expert_styles_is_refused(moe_config):
    """The tiny Qwen3.5-MoE's plan shards experts with packed_colwise / moe_tp_experts, which are not translated
    (its q/k norms' replicated_with_grad_allreduce and linear attention's colwise_gather_output are)."""
    with pytest.raises(ValueError) as err:
        validate_mesh_sizes({"tp_size": 2}, world_size=2, model_config=moe_config)
    message = str(err.value)
    assert "tp_size=2: model_type 'qwen3_5_moe_text' has tensor-parallel styles twinkle cannot apply" in message
    assert "layers.*.mlp.experts.gate_up_proj: packed_colwise" in message and "moe_tp_experts" in message
    assert "replicated_with_grad_allreduce" not in message.split("supported styles")[0]
    assert "Use tp_size=1" in message
