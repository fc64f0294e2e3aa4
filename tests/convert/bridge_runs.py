"""Tiny checkpoints of every Megatron-capable architecture, and the bridge runs the tests read.

Each family's tiny model (tests/family_models.py); those with a single key/value head are rebuilt with 2,
so that tp=2 can split their query groups (megatron splits whole groups; the real checkpoints have 8).
Plus a Qwen3 model with tied embeddings (as Qwen3-0.6B), a Llama with YaRN rope, and Qwen2-MoE (no registry
family: an untested architecture the table expresses). DeepSeek R1 is the V3
architecture: multi-latent attention, a dense first layer, then routed + shared experts; Qwen3 MoE routes
with a softmax top-k and has no shared expert.
One worker run per layout checks all of them: tp2 first (it also saves dist checkpoints), then tp1, pp2
and ep2 (experts split over 2 ranks), which also load those.
"""
from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM

from family_models import save_tiny_family_model
from tiny_models import randomize_norms
from twinkle_core.convert.megatron_checkpoint import copy_hf_side_files
from twinkle_core.hub.internlm2 import convert_internlm2_to_llama
from twinkle_core.launch import run_streaming, torchrun_command

TESTS = Path(__file__).resolve().parents[1]
WORKER_PATH = os.pathsep.join([str(TESTS / "convert"), str(TESTS), str(TESTS.parent)])
RUN_TIMEOUT_S = 300

# name → (registry family, family_models variant); the Megatron-capable families with their tiny shapes, and
# two shapes no family checkpoint has (built below): tied embeddings, and YaRN rope outside MLA.
MODELS = {"llama3": ("llama3", "dense"), "qwen2_5": ("qwen2_5", "dense"), "mistral": ("mistral", "dense"),
          "yi": ("yi", "dense"), "internlm2_5": ("internlm2_5", "dense"), "deepseek_r1": ("deepseek_r1", "moe"),
          "qwen3": ("qwen3", "dense"), "qwen3_moe": ("qwen3", "moe"), "qwen3_tied": ("qwen3", None),
          "llama_yarn": ("llama3", None), "qwen2_moe": ("untested-qwen2_moe", None)}
LAYOUTS = {"tp2": {"tp": 2}, "tp1": {}, "pp2": {"pp": 2}, "ep2": {"ep": 2}}
NPROC = {"tp2": 2, "tp1": 1, "pp2": 2, "ep2": 2}
ONLY = {"ep2": ["deepseek_r1", "qwen3_moe", "qwen2_moe"]}  # expert parallelism needs experts


DIST_SAVED_AT = "tp2"


def layout_models(layout: str) -> list[str]:
    return ONLY.get(layout, list(MODELS))


def _save_fresh(config, dst: Path, side_files_from: Path, norms: bool = False) -> Path:
    """A model of `config` with fresh weights (fixed seed), beside another checkpoint's tokenizer and generation
    config; `norms` draws its norm weights at random."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    if norms:
        randomize_norms(model)
    model.save_pretrained(dst)
    copy_hf_side_files(side_files_from, dst)
    config.save_pretrained(dst)
    return dst


def _with_two_kv_heads(src: Path, dst: Path) -> Path:
    """The same architecture with 2 key/value heads, config and tokenizer kept."""
    config = AutoConfig.from_pretrained(src)
    config.num_key_value_heads = 2
    return _save_fresh(config, dst, src)


def _qwen3_tied(dst: Path, tokenizer_src: Path) -> Path:
    """Qwen3-0.6B-like: RMSNorm on each q/k head (random, so a q/k norm mapped wrongly shows in the logits),
    tied embeddings, GQA 2:1, head_dim ≠ hidden/heads."""
    config = AutoConfig.for_model("qwen3", vocab_size=AutoConfig.from_pretrained(tokenizer_src).vocab_size,
                                  hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, head_dim=32, tie_word_embeddings=True, rms_norm_eps=1e-6,
                                  max_position_embeddings=4096, rope_parameters={"rope_type": "default",
                                                                                 "rope_theta": 1_000_000.0})
    return _save_fresh(config, dst, tokenizer_src, norms=True)


def _llama_yarn(dst: Path, tokenizer_src: Path) -> Path:
    """A Llama with YaRN rope (factor 4 over 64 original positions: the probe's 24 tokens see the scaled
    frequencies), so megatron must rotate by HF's YaRN frequencies and scale cos/sin by its attention factor."""
    config = AutoConfig.from_pretrained(tokenizer_src)
    config.rope_parameters = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                              "original_max_position_embeddings": 64}
    return _save_fresh(config, dst, tokenizer_src)


def _qwen2_moe(dst: Path, tokenizer_src: Path) -> Path:
    """Qwen1.5/Qwen2-MoE, a family outside the registry that the table expresses: qkv bias, a dense first layer
    (mlp_only_layers), softmax top-k without renormalisation, a sigmoid-gated shared expert."""
    vocab = AutoConfig.from_pretrained(tokenizer_src).vocab_size
    config = AutoConfig.for_model("qwen2_moe", vocab_size=vocab, hidden_size=64, intermediate_size=96,
                                  moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=4,
                                  num_experts_per_tok=2, norm_topk_prob=False, mlp_only_layers=[0],
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                  tie_word_embeddings=False, rms_norm_eps=1e-6, max_position_embeddings=4096,
                                  use_sliding_window=False)
    return _save_fresh(config, dst, tokenizer_src)


def build_models(root: Path) -> dict[str, Path]:
    models = {}
    for name, (family, variant) in MODELS.items():
        if variant is None:
            continue
        raw = save_tiny_family_model(family, root / "raw" / name, variant)
        if family == "internlm2_5":  # the family is converted to the Llama layout on download
            convert_internlm2_to_llama(raw, root / "raw" / "internlm2_5_llama")
            raw = root / "raw" / "internlm2_5_llama"
        single_kv_head = AutoConfig.from_pretrained(raw).num_key_value_heads == 1
        models[name] = _with_two_kv_heads(raw, root / "hf" / name) if single_kv_head else raw
    models["qwen3_tied"] = _qwen3_tied(root / "hf" / "qwen3_tied", models["qwen2_5"])
    models["llama_yarn"] = _llama_yarn(root / "hf" / "llama_yarn", models["llama3"])
    models["qwen2_moe"] = _qwen2_moe(root / "hf" / "qwen2_moe", models["qwen2_5"])
    return models


@dataclass
class BridgeRuns:
    root: Path
    models: dict[str, Path]

    def out(self, model: str, layout: str) -> Path:
        return self.root / "out" / model / layout

    def logits(self, model: str, layout: str, source: str = "hf") -> torch.Tensor:
        return load_file(self.out(model, layout) / f"logits_{source}.safetensors")["logits"]


def write_job(root: Path, models: dict[str, Path]) -> Path:
    job = {"layouts": LAYOUTS, "save_dist": DIST_SAVED_AT, "only": ONLY,
           "load_dist": {name: DIST_SAVED_AT for name in LAYOUTS if name != DIST_SAVED_AT},
           "models": [{"name": name, "family": MODELS[name][0], "hf_dir": str(path),
                       "out": str(root / "out" / name), "max_shard_bytes": 40_000}
                      for name, path in models.items()]}
    path = root / "job.json"
    path.write_text(json.dumps(job, indent=2))
    return path


def run_layout(job: Path, layout: str) -> None:
    args = [str(job), layout]
    nproc = NPROC[layout]
    cmd = ([sys.executable, "-m", "bridge_worker", *args] if nproc == 1
           else torchrun_command("bridge_worker", args, nproc_per_node=nproc))
    env = {"PYTHONPATH": WORKER_PATH, "OMP_NUM_THREADS": "1"}
    run_streaming(cmd, lambda line: None, timeout_s=RUN_TIMEOUT_S, env=env)
