"""The Transformer Engine paths of the megatron backend, as far as a machine without CUDA can check them.

On CPU: Transformer Engine (and so fp8, context parallelism and packed `thd` rows on megatron) is refused
before anything starts, naming the option and what would work; `transformer_impl` resolves to the local
spec; the document boundaries of packed rows and the context-parallel split are exact; the bridge reads a
TE model's fused-norm names; the prepared H200 script parses its arguments. The GPU test at the end runs
only with CUDA and Transformer Engine, and is not counted as verification here.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from twinkle_core.data.collate import collate
from twinkle_core.data.packing import pack_examples
from twinkle_core.megatron.engine import fp8_settings, resolve_transformer_impl, transformer_engine_problem
from twinkle_core.megatron.packed import (cu_seqlens_from_starts, document_starts_from_mask,
                                          document_starts_from_positions, split_for_context_parallel)

REPO = Path(__file__).resolve().parents[2]
no_te = pytest.mark.skipif(transformer_engine_problem() is None, reason="Transformer Engine runs here")


def _problems(backend: str, kind: str = "sft", **fields) -> list[str]:
    """The backend's registered rules (what check_run runs before launch) on a flow's settings."""
    from twinkle_core.models.backends import get_backend
    from twinkle_core.parallel import ParallelConfig

    parallel = ParallelConfig(**{k: v for k, v in fields.items() if k in ParallelConfig.model_fields})
    settings = {"mixed_precision": "bf16", "use_lora": False, **fields}
    config = SimpleNamespace(kind=kind, backend=backend, parallel=lambda: parallel, **settings)
    return [problem for rule in get_backend(backend).rules for problem in rule(config, None)]


def test_the_options_travel_in_every_run_configs_parallel_settings():
    from twinkle_core.parallel import ParallelConfig

    parallel = ParallelConfig(cp_size=2, transformer_impl="transformer_engine", fp8_recipe="delayed")
    assert ParallelConfig.model_validate_json(parallel.model_dump_json()) == parallel
    assert ParallelConfig().transformer_impl is None and ParallelConfig().fp8_recipe == "tensorwise"


@no_te
def test_transformer_impl_resolves_to_the_local_spec_without_cuda():
    assert resolve_transformer_impl(None) == "local"
    assert resolve_transformer_impl("local") == "local"
    assert resolve_transformer_impl(None, lora=True) == "local"
    with pytest.raises(ValueError, match=r"transformer_impl='transformer_engine': Transformer Engine needs a CUDA "
                                         r"GPU.*use transformer_impl='local'"):
        resolve_transformer_impl("transformer_engine")
    with pytest.raises(ValueError, match="transformer_impl='flash'.*'local', 'transformer_engine'"):
        resolve_transformer_impl("flash")


@no_te
@pytest.mark.parametrize("fields,words", [
    ({"transformer_impl": "transformer_engine"},
     ["transformer_impl='transformer_engine'", "CUDA", "transformer_impl='local'"]),
    ({"mixed_precision": "fp8"}, ["mixed_precision='fp8'", "Transformer Engine's layers", "CUDA", "bf16"]),
    ({"cp_size": 2, "nproc_per_node": 2}, ["cp_size=2", "Transformer Engine's attention", "cp_size=1"]),
    ({"packing": True}, ["packing=True", "thd", "packing=false"]),
])
def test_engine_options_are_refused_on_megatron_without_transformer_engine(fields, words):
    problems = _problems("megatron", **fields)
    assert len(problems) == 1 and problems[0].startswith("backend='megatron': ")
    for word in words:
        assert word in problems[0]


def test_explicit_transformer_engine_with_lora_is_refused():
    with pytest.raises(ValueError, match="with LoRA.*transformer_impl='local'"):
        resolve_transformer_impl("transformer_engine", lora=True)
    assert any("with LoRA" in p for p in _problems("megatron", transformer_impl="transformer_engine", use_lora=True))


@no_te
def test_context_parallel_sequence_length_must_split_into_two_chunks_per_rank():
    problems = _problems("megatron", kind="pretrain", cp_size=2, nproc_per_node=2, seq_length=66,
                         document_masks=False)
    assert any("seq_length=66 must be a multiple of 2 x cp_size=4" in p and "seq_length=64" in p for p in problems)
    assert not any("seq_length" in p for p in _problems("megatron", kind="pretrain", cp_size=2, nproc_per_node=2,
                                                           seq_length=64, document_masks=False))
    with pytest.raises(ValueError, match="sequence length 6 is not a multiple of 2 x cp_size=4"):
        split_for_context_parallel({"tokens": torch.zeros(1, 6)}, cp_size=2, cp_rank=0)


def test_context_parallel_layouts_count_cp_in_the_processes():
    from twinkle_core.megatron import MegatronParallel

    MegatronParallel(tp=2, cp=2).check(8)
    with pytest.raises(ValueError, match="tp=2 x cp=2 x pp=1 does not divide the 6 processes"):
        MegatronParallel(tp=2, cp=2).check(6)


@pytest.mark.parametrize("fields,word", [
    ({"cp_size": 2, "nproc_per_node": 2}, "cp_size=2: context parallelism belongs to the megatron"),
    ({"transformer_impl": "local"}, "transformer_impl='local': the layer implementation is a megatron option"),
    ({"fp8_recipe": "delayed"}, "fp8_recipe='delayed'"),
])
def test_engine_options_are_refused_on_transformers(fields, word):
    assert any(word in problem for problem in _problems("transformers", **fields))


def test_fp8_recipes_map_to_transformer_config_fields():
    assert fp8_settings("tensorwise") == {"fp8": "hybrid", "fp8_recipe": "tensorwise"}
    assert fp8_settings("delayed") == {"fp8": "hybrid", "fp8_recipe": "delayed", "fp8_amax_history_len": 1024,
                                       "fp8_amax_compute_algo": "max", "fp8_margin": 0}
    with pytest.raises(ValueError, match="fp8_recipe='mxfp8'"):
        fp8_settings("mxfp8")


def _packed_batch() -> dict:
    def example(length: int, first: int) -> dict:
        ids = list(range(first, first + length))
        return {"input_ids": ids, "labels": ids}

    packs = pack_examples([example(3, 10), example(2, 20), example(4, 30)], max_length=6)
    return collate(packs, pad_token_id=0, pad_to_multiple_of=8)  # rows: [3 | 2 | 3 pads], [4 | 4 pads]


def test_packed_rows_give_the_exact_document_boundaries():
    batch = _packed_batch()
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 0, 0], [0, 1, 2, 3, 0, 0, 0, 0]]
    starts = document_starts_from_positions(batch["position_ids"])
    cu_seqlens, longest = cu_seqlens_from_starts(starts)
    assert cu_seqlens.dtype == torch.int32
    assert cu_seqlens.tolist() == [0, 3, 5, 8, 12, 16] and longest == 4  # trailing padding: one segment
    # the same documents from the block-causal mask (its padding tokens each see only themselves)
    cu_mask, _ = cu_seqlens_from_starts(document_starts_from_mask(batch["attention_mask"]))
    assert cu_mask.tolist() == [0, 3, 5, 6, 7, 8, 12, 13, 14, 15, 16]


def test_packed_rows_become_one_thd_sequence_per_micro_batch():
    from twinkle_core.megatron.step import split_micro_batches

    batch = _packed_batch()
    with pytest.raises(ValueError, match="position_ids restart inside a row"):  # the local spec's refusal
        split_micro_batches(batch, 2, packed_documents=False)
    (micro,) = split_micro_batches(batch, 2, packed_documents=True)
    assert micro.tokens.tolist() == [[10, 11, 12, 20, 21, 0, 0, 0, 30, 31, 32, 33, 0, 0, 0, 0]]
    assert micro.attention_mask is None and micro.packed_seq_params.qkv_format == "thd"
    assert micro.packed_seq_params.cu_seqlens_q.tolist() == [0, 3, 5, 8, 12, 16]
    assert micro.packed_seq_params.max_seqlen_q == 4
    # labels are shifted inside each row; a document's first token is never predicted from the previous one
    assert micro.labels.tolist() == [[11, 12, 0, 21, 0, 0, 0, 0, 31, 32, 33, 0, 0, 0, 0, 0]]
    assert micro.loss_mask.tolist() == [[1, 1, 0, 1, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0, 0, 0]]


def test_context_parallel_split_gives_each_rank_two_balanced_chunks():
    tokens = torch.arange(16).reshape(2, 8)
    rank0 = split_for_context_parallel({"tokens": tokens}, cp_size=2, cp_rank=0)["tokens"]
    rank1 = split_for_context_parallel({"tokens": tokens}, cp_size=2, cp_rank=1)["tokens"]
    assert rank0.tolist() == [[0, 1, 6, 7], [8, 9, 14, 15]]
    assert rank1.tolist() == [[2, 3, 4, 5], [10, 11, 12, 13]]


def test_the_bridge_reads_a_transformer_engine_models_fused_norm_names():
    from twinkle_core.convert.mapping import table_names

    names = ["decoder.layers.0.self_attention.linear_qkv.layer_norm_weight", "decoder.layers.0.mlp.linear_fc1.weight",
             "decoder.layers.0.mlp.linear_fc1.layer_norm_weight", "decoder.final_layernorm.weight"]
    te = SimpleNamespace(config=SimpleNamespace(transformer_impl="transformer_engine", multi_latent_attention=False))
    assert table_names(te, names) == {
        names[0]: "decoder.layers.0.input_layernorm.weight", names[1]: names[1],
        names[2]: "decoder.layers.0.pre_mlp_layernorm.weight", names[3]: names[3]}
    local = SimpleNamespace(config=SimpleNamespace(transformer_impl="local", multi_latent_attention=False))
    assert table_names(local, names) == {name: name for name in names}


def test_the_local_spec_refuses_fp8_and_context_parallelism():
    from transformers import Qwen2Config

    from twinkle_core.megatron import MegatronParallel, transformer_config_from_hf

    config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    with pytest.raises(ValueError, match="transformer_impl='transformer_engine'"):
        transformer_config_from_hf(config, fp8=fp8_settings("delayed"))
    with pytest.raises(ValueError, match="transformer_impl='transformer_engine'"):
        transformer_config_from_hf(config, MegatronParallel(cp=2))
    assert transformer_config_from_hf(config).transformer_impl == "local"


def test_the_prepared_gpu_script_parses_its_arguments():
    help_text = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_megatron.py"), "--help"], cwd=REPO,
                               capture_output=True, text=True, check=True, timeout=60).stdout
    assert "--cases" in help_text and "--seq-len" in help_text
    shell = subprocess.run(["bash", str(REPO / "bench" / "gpu_megatron.sh"), "--help"], cwd=REPO,
                           capture_output=True, text=True, check=True, timeout=60).stdout
    assert "receive 1" in shell and "bash bench/gpu_megatron.sh run" in shell


@pytest.mark.skipif(transformer_engine_problem() is not None, reason="needs CUDA and Transformer Engine")
def test_on_a_gpu_the_default_is_transformer_engine():  # not counted as verification on CPU machines
    assert resolve_transformer_impl(None) == "transformer_engine"


def test_the_prepared_gpu_script_prints_its_table_and_checks():
    sys.path.insert(0, str(REPO / "bench"))
    from gpu_megatron import table

    def case(name, tokens_per_s, loss):
        return {"case": name, "tokens_per_s": tokens_per_s, "mfu": tokens_per_s / 1e5, "peak_memory_gb": 30.0,
                "loss": loss}

    results = [case("local-bf16", 20000, 5.0), case("te-bf16", 50000, 5.05), case("te-fp8-delayed", 60000, 5.2),
               {"case": "te-fp8-tensorwise", "error": "exit 1: no TE"}]
    transformers = {"rows": [{"precision": "bf16", "tokens_per_s": 25000, "mfu_vs_bf16_peak": 0.2,
                              "peak_memory_gb": 40.0, "final_loss": 5.01}]}
    round_trip = {"exact": True, "tensors": 100, "fused_norm_params": 18, "unequal": [], "missing": [], "extra": []}
    text = "\n".join(table(results, transformers, round_trip))
    assert "te-fp8-tensorwise    not run: exit 1: no TE" in text
    assert "check losses within 2% of local-bf16: FAIL (largest: te-fp8-delayed, 4.00%)" in text
    assert "check TE bf16 MFU >= 45%: PASS (50.0%)" in text
    assert "check te-fp8-delayed faster than te-bf16: PASS (1.20x)" in text
    assert "megatron te-bf16 / transformers bf16 tokens/s: 2.00x" in text
    assert "check HF -> Megatron(TE) -> HF exact: PASS (100 tensors, 18 TE fused-norm parameters" in text
