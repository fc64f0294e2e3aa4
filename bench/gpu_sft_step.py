"""The SFT step on a CUDA GPU: does a micro-batch wait for the device, and does `--compile` pay?

On a machine with a CUDA GPU, from the repository root (after `make install`):

    python bench/gpu_sft_step.py                     # the default model, bundled and generated sets, bf16
    python bench/gpu_sft_step.py --model-id hf://Qwen/Qwen2.5-0.5B-Instruct --steps 40

1. **Host syncs.** The micro-batches of the first steps run under `torch.cuda.set_sync_debug_mode("error")`:
   any read of a device value inside forward_backward (`.item()`, a boolean index, a blocking copy) raises and
   is reported with the operation that waited. The step's own read (`clip_grad_and_step`) runs outside it.
2. **`--compile`.** The same LoRA SFT (r=8 on every linear layer, AdamW lr 1e-3, clip 1.0, batches of
   `--batch-size` rows, padding-free with the shared prompt prefix held once), eager and with compiled decoder
   layers, on the bundled self-cognition set and on a generated set of varied lengths (50-1000 tokens):
   trained tokens/s over the steps after the first two (compilation and warm-up), the first step's seconds, and
   the last loss of both (compiled bf16 kernels round differently, so they agree to about 1 %, not bit for bit).

Prints a markdown table and writes results.json to `$OUT` (default ./gpu-results). On a machine without CUDA
it runs the same steps on the CPU (`--steps 3` is a quick check of the script) and skips the sync check.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_sft import BUNDLED, DEFAULT_MODEL, LORA, LR, ordered_rows, write_generated  # noqa: E402


def sync_check(model, batches: list[list[dict]]) -> str:
    """'none' when no micro-batch waited for the device, else the first error (the operation that waited)."""
    import torch

    from twinkle_core.data import collate_padding_free

    for rows in batches:
        torch.cuda.set_sync_debug_mode("error")
        try:
            model.forward_backward(collate_padding_free(rows))
        except RuntimeError as exc:
            return str(exc).splitlines()[0][:200]
        finally:
            torch.cuda.set_sync_debug_mode("default")
        model.clip_grad_and_step(1.0)
    return "none"


def train(model_dir: str, batches: list[list[dict]], compile: bool, precision: str) -> dict:
    import torch
    from peft import LoraConfig

    from twinkle_core.data import collate_padding_free
    from twinkle_core.models import TransformersModel

    model = TransformersModel(model_dir, mixed_precision=precision, compile=compile)
    torch.manual_seed(0)
    model.add_adapter_to_model("default", LoraConfig(**LORA))
    model.set_optimizer("AdamW", lr=LR, weight_decay=0.0)
    cuda = model.device.type == "cuda"
    syncs = sync_check(model, batches[:2]) if cuda and not compile else "not checked"
    seconds, trained, losses = [], [], []
    for rows in batches:
        start = time.perf_counter()
        losses.append(model.forward_backward(collate_padding_free(rows)))
        model.clip_grad_and_step(1.0)
        if cuda:
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
        trained.append(sum(sum(1 for label in r["labels"][1:] if label != -100) for r in rows))
    measured = seconds[2:] or seconds
    return {"compile": compile, "device": str(model.device), "first_step_s": seconds[0],
            "median_step_s": statistics.median(measured),
            "trained_tokens_per_s": sum(trained[-len(measured):]) / sum(measured),
            "last_loss": float(losses[-1]), "syncs_in_micro_batches": syncs,
            "peak_gpu_mb": torch.cuda.max_memory_allocated() / 2**20 if cuda else None}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-id", default=DEFAULT_MODEL)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--precision", default="auto")
    args = parser.parse_args()

    import torch

    from twinkle_core.hub.models import resolve_model

    out = Path(os.environ.get("OUT", "gpu-results"))
    out.mkdir(parents=True, exist_ok=True)
    model_dir = str(resolve_model(args.model_id).path)
    results = []
    with tempfile.TemporaryDirectory(prefix="gpu-sft-") as tmp:
        sets = {"bundled": BUNDLED, "generated": write_generated(Path(tmp) / "generated.jsonl", 20 * args.batch_size)}
        for name, data in sets.items():
            batches = ordered_rows(data, model_dir, args.batch_size, args.steps, 1024)
            for compile in (False, True):
                torch.cuda.empty_cache() if torch.cuda.is_available() else None
                result = {"set": name, **train(model_dir, batches, compile, args.precision)}
                print(json.dumps(result), flush=True)
                results.append(result)
                (out / "results.json").write_text(json.dumps(results, indent=1))  # kept if a later run is cut off
    print("\n| set | layers | device | trained tok/s | median step s | first step s | last loss | micro-batch syncs |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['set']} | {'compiled' if r['compile'] else 'eager'} | {r['device']} | "
              f"{r['trained_tokens_per_s']:.0f} | {r['median_step_s']:.3f} | {r['first_step_s']:.1f} | "
              f"{r['last_loss']:.4f} | {r['syncs_in_micro_batches']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
