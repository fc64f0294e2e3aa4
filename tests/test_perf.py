"""Performance metrics: FLOPs per token against hand counts, the measured CPU peak, MFU, peak memory."""
import time

import pytest
import torch
from transformers import AutoConfig

from twinkle_core import perf

VOCAB, HIDDEN, INTER, LAYERS, HEADS, KV_HEADS = 384, 32, 64, 2, 4, 2


def tiny_llama_config(**overrides):
    settings = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=LAYERS,
                    num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, tie_word_embeddings=True)
    return AutoConfig.for_model("llama", **{**settings, **overrides})


def hand_count_matmul_params() -> int:
    """Parameters a token multiplies with in the tiny llama: projections, MLP, norms and the output layer."""
    head_dim = HIDDEN // HEADS
    attention = 2 * HIDDEN * HEADS * head_dim + 2 * HIDDEN * KV_HEADS * head_dim  # q, o; k, v
    mlp = 3 * HIDDEN * INTER  # gate, up, down
    per_layer = attention + mlp + 2 * HIDDEN  # two RMSNorms
    return LAYERS * per_layer + HIDDEN + VOCAB * HIDDEN  # final norm; lm_head (embedding lookup excluded)


@pytest.mark.parametrize("tied", [True, False])
def test_full_training_flops_per_token_match_a_hand_count(tied):
    seq_len = 128
    expected = 6 * hand_count_matmul_params() + 12 * LAYERS * HIDDEN * seq_len
    assert hand_count_matmul_params() == 30_880
    assert perf.model_flops_per_token(tiny_llama_config(tie_word_embeddings=tied), seq_len) == expected


def test_attention_adds_12_L_H_per_token_of_context():
    config = tiny_llama_config()
    longer = perf.model_flops_per_token(config, 256) - perf.model_flops_per_token(config, 128)
    assert longer == 12 * LAYERS * HIDDEN * 128


def test_lora_skips_the_base_weight_gradients():
    config, lora_params = tiny_llama_config(), 4_000
    full = perf.model_flops_per_token(config, 128)
    lora = perf.model_flops_per_token(config, 128, lora_params=lora_params)
    assert lora == full - 2 * hand_count_matmul_params() + 6 * lora_params
    assert lora < full


def test_moe_counts_only_the_experts_a_token_is_routed_to():
    def flops(top_k):
        config = AutoConfig.for_model("qwen3_moe", vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER,
                                      moe_intermediate_size=16, num_experts=4, num_experts_per_tok=top_k,
                                      num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                                      num_key_value_heads=KV_HEADS, head_dim=8)
        return perf.model_flops_per_token(config, 64)

    one_more_expert = 6 * LAYERS * 3 * HIDDEN * 16  # gate, up, down of one expert, in each layer
    assert flops(2) - flops(1) == pytest.approx(one_more_expert)
    assert flops(4) - flops(1) == pytest.approx(3 * one_more_expert)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_measured_cpu_peak_is_positive_sane_and_cached(dtype):
    peak = perf.peak_flops("cpu", dtype)
    # From a CPU without bf16 units (emulated bf16 ran at 0.3 GFLOP/s) to far above any CPU socket.
    assert 1e7 < peak < 5e13
    started = time.perf_counter()
    assert perf.peak_flops("cpu", dtype) == peak  # measured once per process
    assert time.perf_counter() - started < 0.01
    assert perf.peak_flops_source("cpu", dtype).startswith("measured")


@pytest.mark.parametrize("name,dtype,expected", [
    ("NVIDIA H100 80GB HBM3", torch.bfloat16, 989e12),
    ("NVIDIA H200", torch.bfloat16, 989e12),
    ("NVIDIA H200", torch.float8_e4m3fn, 1979e12),
    ("NVIDIA H100 PCIe", torch.bfloat16, 756e12),
    ("NVIDIA A100-SXM4-80GB", torch.bfloat16, 312e12),
])
def test_known_gpus_use_the_datasheet_dense_peak(monkeypatch, name, dtype, expected):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert perf.peak_flops("cuda", dtype) == expected
    assert perf.peak_flops_source("cuda", dtype).startswith("datasheet")


def test_an_fp8_peak_that_cannot_be_measured_names_the_fix():
    with pytest.raises(ValueError, match="peak_flops="):
        perf.peak_flops("cpu", torch.float8_e4m3fn)


def test_mfu_arithmetic():
    assert perf.mfu(tokens_per_s=1_000, flops_per_token=6e9, peak=12e12) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="peak=0"):
        perf.mfu(1_000, 6e9, peak=0)


def test_cpu_peak_memory_is_this_process_high_water_mark():
    with open("/proc/self/status") as status:
        fields = dict(line.split(":", 1) for line in status)
    high_water_mark = int(fields["VmHWM"].split()[0]) * 1024
    assert perf.peak_memory_bytes("cpu") == pytest.approx(high_water_mark, rel=0.05)


def test_step_perf_reports_total_throughput_mfu_and_memory():
    config = tiny_llama_config()
    step = perf.StepPerf(config, seq_len=128, device="cpu", world_size=2, peak=1e12)
    metrics = step.metrics(tokens_per_s=500.0)
    assert metrics["tokens_per_s_total"] == 1_000.0
    assert metrics["mfu"] == pytest.approx(500.0 * perf.model_flops_per_token(config, 128) / 1e12)
    assert metrics["peak_memory_mb"] == pytest.approx(perf.peak_memory_bytes("cpu") / 2**20, rel=0.05)
    assert step.describe()["peak_source"] == "given"


def test_tensor_parallel_ranks_share_their_tokens():
    config = tiny_llama_config()
    tp2 = perf.StepPerf(config, seq_len=128, device="cpu", world_size=2, data_parallel_size=1, peak=1e12)
    metrics = tp2.metrics(tokens_per_s=500.0)
    assert metrics["tokens_per_s_total"] == 500.0  # both ranks trained the same tokens
    assert metrics["mfu"] == pytest.approx(500.0 * perf.model_flops_per_token(config, 128) / 2e12)


def test_step_perf_on_cpu_measures_its_peak():
    step = perf.StepPerf(tiny_llama_config(), seq_len=128, device="cpu", dtype=torch.bfloat16)
    assert step.peak == perf.peak_flops("cpu", torch.bfloat16)
    assert "measured bf16" in step.describe()["peak_source"]
    # A throughput at half the measured peak reads as 50% MFU, whatever this CPU's peak is.
    half_peak = 0.5 * step.peak / step.flops_per_token
    assert step.metrics(tokens_per_s=half_peak)["mfu"] == pytest.approx(0.5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_peak_and_memory():
    peak = perf.peak_flops("cuda", torch.bfloat16)
    measured = perf.measured_matmul_flops(torch.device("cuda"), torch.bfloat16)
    assert 0 < measured <= 1.05 * peak  # a datasheet peak is an upper bound
    x = torch.ones(256, 2**20, device="cuda")  # 1 GiB
    assert perf.peak_memory_bytes("cuda") >= x.numel() * 4


def test_measuring_the_peak_leaves_the_global_rng_alone():
    """How many matrix sizes are timed depends on the load; draws from the global generator would shift
    every later dropout mask, so two runs with one seed would train differently on a busy machine."""
    from twinkle_core.perf import measured_matmul_flops

    before = torch.get_rng_state()
    assert measured_matmul_flops.__wrapped__(torch.device("cpu"), torch.float32) > 0
    assert torch.equal(torch.get_rng_state(), before)
