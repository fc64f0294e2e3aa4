"""bf16 vs fp8 full fine-tuning on a ~0.5B-parameter model (GPU check of the precision policies).

    python bench/gpu_precision.py --model-dir DIR      # DIR: a Hugging Face directory (random init is fine)

Trains the same model on the same fixed random batches for --steps steps in each precision and prints
tokens/s (after --warmup steps), MFU against the chip's dense peak, peak GPU memory and the final losses.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PEAK_TFLOPS = {"bf16": 989.0, "fp8": 1979.0}  # H100/H200 SXM dense tensor-core peaks


def compile_layers(model) -> None:
    """torch.compile each decoder layer: fuses the float8 casts and scaling with their neighbours."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    for layer in base.get_decoder().layers:
        layer.compile()


def run(model_dir: str, precision: str, batches: list[dict], warmup: int, compile: bool) -> dict:
    from twinkle_core.models import TransformersModel

    torch.manual_seed(0)
    torch.cuda.reset_peak_memory_stats()
    model = TransformersModel(model_dir, mixed_precision=precision)
    if compile:
        compile_layers(model.model)
    model.set_optimizer("AdamW", lr=1e-4)
    params = sum(p.numel() for p in model.model.parameters())
    losses, start = [], None
    for i, batch in enumerate(batches):
        if i == warmup:
            torch.cuda.synchronize()
            start = time.perf_counter()
        losses.append(float(model.forward_backward(inputs=batch)))
        model.clip_grad_and_step(max_grad_norm=1.0)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    tokens = sum(b["input_ids"].numel() for b in batches[warmup:])
    config = model.model.config
    seq = batches[0]["input_ids"].shape[1]
    flops_per_token = 6 * params + 12 * config.num_hidden_layers * config.hidden_size * seq
    tokens_per_s = tokens / seconds
    return {"precision": precision, "compiled": compile, "params": params, "tokens_per_s": tokens_per_s,
            "mfu_vs_bf16_peak": flops_per_token * tokens_per_s / (PEAK_TFLOPS["bf16"] * 1e12),
            "peak_memory_gb": torch.cuda.max_memory_allocated() / 2**30, "losses": losses}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--compile", action="store_true", help="torch.compile each decoder layer")
    parser.add_argument("--precisions", default="bf16,fp8", help="comma-separated (fp8 needs torchao)")
    args = parser.parse_args()
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(args.model_dir).vocab_size
    # Rows are shifted copies of one repeating 256-token pattern: learnable, so the loss falls quickly and
    # the bf16-vs-fp8 comparison is about learning, not about noise on random tokens.
    gen = torch.Generator().manual_seed(0)
    pattern = torch.randint(0, vocab, (256,), generator=gen).repeat(args.seq_len // 256 + 2)
    batches = []
    for _ in range(args.steps):
        offsets = torch.randint(0, 256, (args.batch_size,), generator=gen)
        ids = torch.stack([pattern[o:o + args.seq_len] for o in offsets.tolist()])
        batches.append({"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)})
    results = [run(args.model_dir, p, batches, args.warmup, args.compile) for p in args.precisions.split(",")]
    for r in results:
        print(json.dumps({**{k: v for k, v in r.items() if k != "losses"}, "final_loss": r["losses"][-1]}))
    if len(results) == 2:
        first, second = results
        print(f"loss after {args.steps} steps: {first['precision']} {first['losses'][-1]:.4f}, {second['precision']} "
              f"{second['losses'][-1]:.4f}, difference {abs(first['losses'][-1] - second['losses'][-1]):.4f}")
        print(f"{second['precision']} / {first['precision']} tokens/s: "
              f"{second['tokens_per_s'] / first['tokens_per_s']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
