"""Training performance numbers: model FLOPs per token, peak FLOP/s, MFU and peak memory.

    perf = StepPerf(model.config, seq_len=512, device=torch.device("cpu"), world_size=2, dtype=torch.bfloat16)
    perf.metrics(tokens_per_s=300.0)   # {"tokens_per_s_total": 600.0, "mfu": 0.021, "peak_memory_mb": 2730.0}

MFU (model FLOPs utilisation) = tokens/s × model FLOPs per token ÷ the device's peak FLOP/s. Model FLOPs
are what the architecture needs (the standard count below), not what the implementation happens to run,
so a faster trainer shows as a higher MFU. The peak is the datasheet's dense tensor-core number on known
GPUs and a *measured* matmul peak elsewhere (CPUs have no comparable datasheet number): on CPU, MFU is
relative to the best this process reached on large matmuls in the training dtype.
"""
from __future__ import annotations

import functools
import re
import resource
import sys
import time

import torch

# Dense (no sparsity) peak FLOP/s by dtype; the first name fragment found in the device name wins.
_DATASHEET_PEAKS: list[tuple[str, dict[str, float]]] = [
    ("H100 PCIe", {"fp8": 1513e12, "bf16": 756e12, "fp16": 756e12, "tf32": 378e12, "fp32": 51e12}),
    ("H100", {"fp8": 1979e12, "bf16": 989e12, "fp16": 989e12, "tf32": 494.7e12, "fp32": 66.9e12}),
    ("H200", {"fp8": 1979e12, "bf16": 989e12, "fp16": 989e12, "tf32": 494.7e12, "fp32": 66.9e12}),
    ("A100", {"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp32": 19.5e12}),
]
_EXPERT_PARAM = re.compile(r"(^|\.)experts\.")  # routed experts; DeepSeek's shared_experts always run


def model_flops_per_token(config, seq_len: int, lora_params: int | None = None,
                          auto_class: str = "AutoModelForCausalLM") -> float:
    """Training FLOPs per token (forward + backward) of the model `config` describes.

    Full fine-tuning (`lora_params=None`): the standard 6·N, i.e. 2·N forward, 2·N backward to the inputs
    and 2·N backward to the weights, where N counts the parameters that multiply activations (the output
    layer yes, the input embedding lookup no; MoE experts scaled by top-k / experts, as only those run).
    LoRA (`lora_params` = the adapters' parameter count): the base is frozen, so its weight gradients are
    never computed: 2·N forward + 2·N backward to the inputs, plus the adapters' own 6·N_lora.
    Both add attention's score and value matmuls, 12·L·H·S (H = heads × head dim, S = `seq_len`): they
    have no weights and need all three passes either way. As in the PaLM/nanoGPT count, the causal mask's
    halving is not subtracted.
    """
    active = _active_matmul_params(config, auto_class)
    weights = 6 * active if lora_params is None else 4 * active + 6 * lora_params
    return float(weights + _attention_flops_per_token(config, seq_len))


def _active_matmul_params(config, auto_class: str = "AutoModelForCausalLM") -> float:
    """Parameters one token multiplies with, counted on a meta-device build (no memory, any architecture);
    `auto_class` is the head the model trains with (AutoModel: an encoder without the LM head)."""
    import transformers

    with torch.device("meta"):
        model = getattr(transformers, auto_class).from_config(config)
    output = model.get_output_embeddings()
    output_ids = {id(p) for p in output.parameters()} if output is not None else set()
    lookup_ids = {id(p) for p in model.get_input_embeddings().parameters()} - output_ids  # tied: a matmul
    dense = experts = 0
    for name, param in model.named_parameters():  # shared (tied) parameters are listed once
        if id(param) in lookup_ids:
            continue
        if _EXPERT_PARAM.search(name):
            experts += param.numel()
        else:
            dense += param.numel()
    return dense + experts * _expert_fraction(config.get_text_config())


def _expert_fraction(config) -> float:
    """top-k / number of routed experts (1 for dense models)."""
    top_k = getattr(config, "num_experts_per_tok", None)
    total = next((getattr(config, key) for key in ("num_experts", "n_routed_experts", "num_local_experts")
                  if getattr(config, key, None)), None)
    return top_k / total if top_k and total else 1.0


def _attention_flops_per_token(config, seq_len: int) -> float:
    """6 · Σ_layers S_eff · heads · (qk head dim + v head dim): QKᵀ and AV, forward and backward."""
    text = config.get_text_config()
    heads = text.num_attention_heads
    qk_dim = getattr(text, "qk_head_dim", None) or getattr(text, "head_dim", None) or text.hidden_size // heads
    v_dim = getattr(text, "v_head_dim", None) or qk_dim
    layer_types = getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers
    window = min(seq_len, getattr(text, "sliding_window", None) or seq_len)
    # Linear-attention layers (gated delta nets) add nothing beyond their weights; other kinds (e.g.
    # DeepSeek V4's compressed sparse attention) are counted as full attention, an upper bound.
    spans = [0 if kind == "linear_attention" else window if kind == "sliding_attention" else seq_len
             for kind in layer_types]
    return 6.0 * sum(spans) * heads * (qk_dim + v_dim)


def peak_flops(device: torch.device | str, dtype: torch.dtype) -> float:
    """Peak dense FLOP/s of `device` in `dtype`: the datasheet for known GPUs, else a measured matmul peak."""
    device = torch.device(device)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        table = next((peaks for fragment, peaks in _DATASHEET_PEAKS if fragment in name), {})
        if _dtype_key(dtype) in table:
            return table[_dtype_key(dtype)]
    return measured_matmul_flops(device, dtype)


def peak_flops_source(device: torch.device | str, dtype: torch.dtype) -> str:
    """Where `peak_flops` takes its number from, for logs and reports."""
    device = torch.device(device)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        if any(fragment in name and _dtype_key(dtype) in peaks for fragment, peaks in _DATASHEET_PEAKS):
            return f"datasheet dense peak of {name} in {_dtype_key(dtype)}"
    return f"measured {_dtype_key(dtype)} matmul peak on {device.type} ({torch.get_num_threads()} threads)"


def _dtype_key(dtype: torch.dtype) -> str:
    if dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return "fp8"
    if dtype == torch.float32:  # matmuls run in TF32 once float32_matmul_precision allows it
        return "fp32" if torch.get_float32_matmul_precision() == "highest" else "tf32"
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, str(dtype).removeprefix("torch."))


@functools.lru_cache(maxsize=None)
def measured_matmul_flops(device: torch.device, dtype: torch.dtype) -> float:
    """The best FLOP/s of a few square matmuls in `dtype`, measured once per process and device.

    8192² ×4 per timing on GPU (kernel launches amortised). On CPU the size grows from 256² to 2048² while one
    matmul takes under 0.03 s: a CPU without bf16 units emulates bf16 ~100x slower than fp32 (~1 GFLOP/s),
    where a fixed 2048² would take minutes. Measured on 2 cores, 1536² reaches 2048²'s rate (85 GFLOP/s on one
    thread, 173 on two) in 0.04–0.09 s a matmul, so the whole measurement takes ~0.4 s.
    """
    if _dtype_key(dtype) == "fp8":
        raise ValueError(f"dtype={dtype}: no fp8 peak is known for device {device}, and plain matmuls cannot "
                         "measure one; pass the datasheet number (peak_flops=...) to StepPerf.")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def seconds(a, b, repeats: int) -> float:
        started = time.perf_counter()
        for _ in range(repeats):
            torch.mm(a, b)
        sync()
        return time.perf_counter() - started

    sizes, per_timing = ([8192], 4) if device.type == "cuda" else ([256, 512, 1024, 1536, 2048], 1)
    # Its own generator: how many sizes are tried depends on the machine's load, and draws from the global
    # one would shift every later dropout mask, so runs with one seed would differ with the load.
    generator = torch.Generator(device=device).manual_seed(0)
    for size in sizes:
        a = torch.randn(size, size, device=device, generator=generator).to(dtype)
        b = torch.randn(size, size, device=device, generator=generator).to(dtype)
        if seconds(a, b, 1) > 0.03:  # also the warm-up: thread pools, kernel selection
            break
    best = min(seconds(a, b, per_timing) for _ in range(3))
    return 2.0 * size**3 * per_timing / best


def mfu(tokens_per_s: float, flops_per_token: float, peak: float) -> float:
    """Model FLOPs utilisation: the fraction of the peak that the model's own FLOPs reach (0..1)."""
    if peak <= 0:
        raise ValueError(f"peak={peak}: the peak FLOP/s must be positive.")
    return tokens_per_s * flops_per_token / peak


def peak_memory_bytes(device: torch.device | str) -> int:
    """Peak memory of this process: allocated GPU memory on CUDA, the maximum resident set size elsewhere."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024  # macOS reports bytes, Linux kilobytes


class StepPerf:
    """This rank's per-step performance metrics, for the recipe's step events (set up once, then cheap).

    `world_size` ranks share the work; `data_parallel_size` of them train on different tokens (default: all;
    tensor-parallel ranks share theirs). Run tokens/s = this rank's × data_parallel_size, and MFU = run
    tokens/s × FLOPs per token ÷ (world_size × one device's peak): the same as this rank's own MFU under
    data parallelism, and right under tensor parallelism too.
    """

    def __init__(self, config, seq_len: int, device: torch.device | str, world_size: int = 1,
                 dtype: torch.dtype = torch.float32, lora_params: int | None = None, peak: float | None = None,
                 data_parallel_size: int | None = None, auto_class: str = "AutoModelForCausalLM"):
        """`seq_len`: the typical sequence length (attention cost); `peak`: overrides the looked-up peak."""
        self.device = torch.device(device)
        self.world_size = world_size
        self.data_parallel_size = world_size if data_parallel_size is None else data_parallel_size
        self.flops_per_token = model_flops_per_token(config, seq_len, lora_params, auto_class)
        self.dtype, self._peak = dtype, peak
        self.peak_source = "given" if peak is not None else peak_flops_source(self.device, dtype)

    @functools.cached_property
    def peak(self) -> float:
        """Looked up (or measured: ~1 s on a CPU core) on first use, so ranks that report nothing skip it."""
        return self._peak if self._peak is not None else peak_flops(self.device, self.dtype)

    def describe(self) -> dict:
        """The constants behind the MFU, for a one-off setup event."""
        return {"flops_per_token": self.flops_per_token, "peak_tflops": round(self.peak / 1e12, 3),
                "peak_source": self.peak_source, "world_size": self.world_size}

    def metrics(self, tokens_per_s: float) -> dict[str, float]:
        """Run total tokens/s, MFU and this rank's peak memory in MiB, from this rank's tokens/s."""
        total = tokens_per_s * self.data_parallel_size
        return {"tokens_per_s_total": total,
                "mfu": mfu(total, self.flops_per_token, self.world_size * self.peak),
                "peak_memory_mb": peak_memory_bytes(self.device) / 2**20}
