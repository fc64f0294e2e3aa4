"""Sequence parallelism (sp_size=2, Ulysses, 2 processes, gloo, CPU) trains like one process.

Both ranks hold the same rows and each runs half of every sequence (the tiny Llama: 4 attention heads,
2 kv heads, so each rank attends with 2 heads over the whole sequence). Tolerances as in
test_parallel_equivalence (fp32): per-step loss within 1e-4 relative, final weights within 1e-5 absolute;
the trained-token counts are equal; the checkpoint reloads in one process with the one-process run's
logits within 1e-5. The attention itself is compared in float64 with SDPA over the whole sequence
(outputs and q/k/v gradients within 1e-12), including kv heads that sp does not divide and a packed mask.
"""
import json
import math
import sys

import pytest
import torch
from transformers import AutoConfig

from parallel_checks import assert_same_training
from test_parallel_checkpoints import LOGITS_ATOL, _logits, _reload
from twinkle_core.data import collate, load_tokenized, tokenize_dataset
from twinkle_core.data.collate import block_causal_mask
from twinkle_core.launch import run_streaming, torchrun_command
from twinkle_core.parallel import ParallelConfig, check_parallel_config, validate_mesh_sizes
from twinkle_core.parallel.sequence import shard_batch

PAD = 0


def test_sp_matches_one_process(workspace):
    run = workspace.run("sp")
    assert run.result["strategy"] == "ddp"  # the weights are replicated over the sp ranks
    assert_same_training(run, workspace.run("single"))


def test_lora_under_sp_matches_one_process(workspace):
    run, reference = workspace.run("sp_lora"), workspace.run("single_lora")
    assert run.result["trainable"] == reference.result["trainable"]
    assert_same_training(run, reference)


@pytest.mark.parametrize("name", ["sp_native_fsdp", "sp_accelerate_fsdp"])
def test_fsdp_times_sp_shards_over_all_four_ranks_and_matches(workspace, name):
    """4 processes, fsdp_size=2 × sp_size=2: FSDP shards over (and reduces over) all 4 ranks, since sp
    ranks hold different tokens; the loader gives the 2 fsdp ranks different rows."""
    run = workspace.run(name)
    assert run.result["strategy"] == name.removeprefix("sp_")
    assert_same_training(run, workspace.run("single"))
    for share in run.result["shares"]:
        assert share["param_bytes"] / share["param_full_bytes"] == pytest.approx(0.25, abs=0.01)
        assert share["optim_bytes"] / share["optim_full_bytes"] == pytest.approx(0.25, abs=0.01)


def test_packed_sequences_under_sp_match_one_process(workspace):
    """Packed rows (several chats per row, block-causal 4-D mask, position_ids restarting at 0)."""
    data = tokenize_dataset(workspace.root / "train.jsonl", workspace.models["llama"][0], kind="chat",
                            max_length=128, packing=True).path
    runs = {}
    for name, nproc, parallel in [("single_packed", 1, {}), ("sp_packed", 2, dict(sp_size=2))]:
        args = [str(workspace.write_config(name, train_data=data, batch_size=2,
                                           parallel=dict(parallel, nproc_per_node=nproc))),
                str(workspace.root / name / "out")]
        cmd = ([sys.executable, "-m", "train_worker", *args] if nproc == 1
               else torchrun_command("train_worker", args, nproc_per_node=nproc))
        runs[name] = workspace.launch([cmd], name)
    assert_same_training(runs["sp_packed"], runs["single_packed"])


def test_each_sp_rank_attends_from_half_of_every_sequence(workspace):
    """The first attention layer's input on each rank is half of the length one process sees (rounded up), in
    padded batches (sp pads; a padding-free single process would lay each micro-batch's rows end to end)."""
    single = workspace.run("single_padded").result["attention_lengths"][0]
    per_rank = workspace.run("sp").result["attention_lengths"]
    assert len(per_rank) == 2 and len(single) == 8  # 4 steps × 2 micro-batches
    for lengths in per_rank:
        assert lengths == [math.ceil(n / 2) for n in single]


def test_sp_checkpoint_reloads_in_one_process(workspace):
    run, reference = workspace.run("sp"), workspace.run("single")
    model = _reload(workspace, run)
    # the Ulysses attention is not saved: one process attends through twinkle_sdpa (SDPA's masks and kernels)
    assert model.model.config._attn_implementation == "twinkle_sdpa"
    assert (_logits(model) - _logits(_reload(workspace, reference))).abs().max().item() <= LOGITS_ATOL
    probe = collate(load_tokenized(workspace.data["llama"])[:3], pad_token_id=model.tokenizer.pad_token_id)
    # the probe loss the sp run computed over both halves of each sequence, before saving
    assert model.forward_only(probe) == pytest.approx(run.event("checkpoint")["probe_loss"], rel=1e-6)


def test_ulysses_attention_equals_sdpa_over_the_whole_sequence(workspace, tmp_path):
    out = tmp_path / "attention.json"
    cmd = torchrun_command("sp_attention_worker", [str(out)], nproc_per_node=2)
    run_streaming(cmd, lambda line: None, timeout_s=120, env=workspace.env())
    for rank in json.loads(out.read_text()):
        assert rank["round_trip"] == 0.0 and rank["heads_shape"] == [2, 2, 8, 3]  # [b, heads/2, whole seq, d]
        for case in ("gqa", "kv_repeat", "packed"):
            assert rank[case]["max_diff"] <= 1e-12, case
            assert rank[case]["local_shape"] == [2, 4, 4, 8]  # [b, half the sequence, all heads, d]


# ----- slicing (no processes) ------------------------------------------------------------------------
def _batch():
    return {"input_ids": torch.tensor([[11, 12, 13, 14, 15], [21, 22, 23, PAD, PAD]]),
            "labels": torch.tensor([[-100, 12, 13, 14, 15], [-100, -100, 23, -100, -100]]),
            "attention_mask": torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])}


def test_slices_pad_to_a_multiple_of_sp_and_shift_labels_over_the_whole_sequence():
    first, second = (shard_batch(_batch(), rank, 2, PAD) for rank in (0, 1))
    assert first["input_ids"].tolist() == [[11, 12, 13], [21, 22, 23]]
    assert second["input_ids"].tolist() == [[14, 15, PAD], [PAD, PAD, PAD]]
    # targets of positions 0-2 and 3-5: the target at a slice's end is the next slice's first token
    assert first["shift_labels"].tolist() == [[12, 13, 14], [-100, 23, -100]]
    assert second["shift_labels"].tolist() == [[15, -100, -100], [-100, -100, -100]]
    assert first["position_ids"].tolist() == [[0, 1, 2]] * 2 and second["position_ids"].tolist() == [[3, 4, 5]] * 2
    assert "attention_mask" not in first  # right padding: causal over the whole sequence is exact
    trained = sum(int((s["shift_labels"] != -100).sum()) for s in (first, second))
    assert trained == int((_batch()["labels"][:, 1:] != -100).sum()) == 5  # no target lost or added


def test_a_packed_batch_keeps_its_whole_sequence_mask():
    position_ids = torch.tensor([[0, 1, 2, 0, 1]])
    mask = block_causal_mask(position_ids, torch.tensor([5]), torch.float32)
    batch = {"input_ids": torch.arange(5)[None], "labels": torch.arange(5)[None], "position_ids": position_ids,
             "attention_mask": mask}
    shard = shard_batch(batch, 1, 2, PAD)
    assert shard["position_ids"].tolist() == [[0, 1, 0]]  # the second sample's positions, then the pad
    full = shard["attention_mask"]
    assert full.shape == (1, 1, 6, 6) and torch.equal(full[..., :5, :5], mask)
    assert full[0, 0, 5].tolist() == [torch.finfo(torch.float32).min] * 5 + [0.0]  # the pad sees only itself
    without_mask = shard_batch({k: v for k, v in batch.items() if k != "attention_mask"}, 1, 2, PAD)
    assert torch.equal(without_mask["attention_mask"][..., :5, :5], mask[..., :5, :5] == 0)


def test_left_padding_is_refused_with_the_alternative():
    batch = {**_batch(), "attention_mask": torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]])}
    with pytest.raises(ValueError, match=r"sp_size > 1 needs right-padded rows .* pass a 4-D mask"):
        shard_batch(batch, 0, 2, PAD)


# ----- layouts (before launch) -----------------------------------------------------------------------
def test_sp_runs_alone_or_with_dp_fsdp(workspace):
    config = AutoConfig.from_pretrained(workspace.models["llama"][0])
    assert check_parallel_config(ParallelConfig(nproc_per_node=2, sp_size=2), config)["sp_size"] == 2
    sizes = check_parallel_config(ParallelConfig(nproc_per_node=4, sp_size=2), config)
    assert (sizes["fsdp_size"], sizes["sp_size"]) == (2, 2)


def test_sequence_parallel_true_takes_the_ranks_left(workspace):
    config = AutoConfig.from_pretrained(workspace.models["llama"][0])
    assert check_parallel_config(ParallelConfig(nproc_per_node=2, sequence_parallel=True), config)["sp_size"] == 2
    assert ParallelConfig(nproc_per_node=4, dp_size=2, sequence_parallel=True).mesh_sizes() == dict(
        dp_size=2, fsdp_size=1, tp_size=1, ep_size=1, sp_size=2)
    with pytest.raises(ValueError, match=r"sequence_parallel=True leaves no rank to split sequences over"):
        check_parallel_config(ParallelConfig(nproc_per_node=2, dp_size=2, sequence_parallel=True), config)


def test_sp_with_tp_or_ep_is_refused():
    with pytest.raises(ValueError, match=r"sp_size=2 with tp_size=2: sequence parallelism combined with "
                                         r"tensor/expert parallelism is not supported yet; use sp_size=1"):
        check_parallel_config(ParallelConfig(nproc_per_node=4, sp_size=2, tp_size=2))


def test_sp_refuses_models_with_linear_attention_layers(workspace):
    config = AutoConfig.from_pretrained(workspace.models["moe"][0])  # Qwen 3.5: gated-delta-net layers
    with pytest.raises(ValueError, match=r"sp_size=2: model_type 'qwen3_5_moe_text' has \['linear_attention'\] "
                                         r"layers; Ulysses sequence parallelism splits full softmax attention only"):
        validate_mesh_sizes({"sp_size": 2}, world_size=2, model_config=config)
