"""Multi-tenant LoRA throughput: N tenants' small batches in one mixed batch vs one tenant after another.

    python bench/bench_multi_lora.py                         # N = 1, 4, 8 tenants, 2x128-token batches each, bf16
    python bench/bench_multi_lora.py --tenants 1,4 --precision no --steps 2
    python bench/bench_multi_lora.py --backend megatron      # MultiLoraMegatronModel (one process)

Every tenant has its own LoRA adapter (r=8, all-linear) and optimizer on one MultiLoraTransformersModel
(or MultiLoraMegatronModel, where each forward_backward call is one micro-batch of all its rows).
A round gives every tenant one optimizer step on its own batch: `mixed` trains all N batches in one
forward/backward (one base-model pass over N x batch rows), `one-after-another` runs N forward/backwards.
Each measurement runs in its own process (peak memory is that run's own); tokens/s counts every tenant's
tokens over the rounds after the warm-up.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

from bench_lora import DEFAULT_MODEL, fixed_batches, peak_rss_mb

LORA = dict(r=8, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")


def peak_memory_mb() -> float:
    """GPU: peak allocated by torch; CPU: the process's peak resident set (model loading included)."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**20
    return peak_rss_mb()


def build_model(backend: str, path: str, precision: str, tenants: int, rows_per_call: int):
    from twinkle_core.models import MultiLoraMegatronModel, MultiLoraTransformersModel

    if backend == "megatron":
        return MultiLoraMegatronModel(path, mixed_precision=precision, max_loras=tenants, max_r=8,
                                      micro_batch_size=rows_per_call)
    return MultiLoraTransformersModel(path, mixed_precision=precision, max_loras=tenants, max_r=8)


def measure(model_id: str, precision: str, tenants: int, mode: str, batch_size: int, seq_len: int, steps: int,
            warmup: int, backend: str = "transformers") -> dict:
    import torch
    from peft import LoraConfig
    from transformers import AutoTokenizer

    from twinkle_core.hub import resolve_model

    path = str(resolve_model(model_id).path)
    rounds = steps + warmup
    batches = fixed_batches(AutoTokenizer.from_pretrained(path), batch_size, seq_len, rounds * tenants)
    model = build_model(backend, path, precision, tenants, batch_size * (tenants if mode == "mixed" else 1))
    names = [f"tenant{i}" for i in range(tenants)]
    for name in names:
        model.add_adapter_to_model(name, LoraConfig(**LORA))
        model.set_optimizer("AdamW", lr=1e-4, adapter_name=name)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    start = None
    for step in range(rounds):
        if step == warmup:
            start = time.perf_counter()
        own = {name: batches[step * tenants + i] for i, name in enumerate(names)}
        if mode == "mixed":
            together = {k: torch.cat([b[k] for b in own.values()]) for k in own[names[0]]}
            model.forward_backward(inputs=together, adapter_name=[n for n in names for _ in range(batch_size)])
        else:
            for name, batch in own.items():
                model.forward_backward(inputs=batch, adapter_name=name)
        for name in names:
            model.clip_grad_and_step(max_grad_norm=1.0, adapter_name=name)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    model.close()
    return {"tenants": tenants, "mode": mode, "tokens_per_s": steps * tenants * batch_size * seq_len / seconds,
            "peak_memory_mb": peak_memory_mb()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-id", default=DEFAULT_MODEL)
    parser.add_argument("--backend", default="transformers", choices=["transformers", "megatron"])
    parser.add_argument("--precision", default="auto", help="auto (bf16 where native), bf16 or no (fp32)")
    parser.add_argument("--tenants", default="1,4,8", help="comma-separated tenant counts")
    parser.add_argument("--batch-size", type=int, default=2, help="rows per tenant per step")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=3, help="measured rounds (one step of every tenant each)")
    parser.add_argument("--warmup", type=int, default=1, help="unmeasured rounds first")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # "N,mode": measure in this process
    args = parser.parse_args()
    if args.one:
        tenants, mode = args.one.split(",")
        print(json.dumps(measure(args.model_id, args.precision, int(tenants), mode, args.batch_size, args.seq_len,
                                 args.steps, args.warmup, args.backend)))
        return 0
    results = {}
    for tenants in map(int, args.tenants.split(",")):
        for mode in ("one-after-another", "mixed"):
            cmd = [sys.executable, __file__, "--one", f"{tenants},{mode}", "--model-id", args.model_id, "--backend",
                   args.backend,
                   "--precision", args.precision, "--batch-size", str(args.batch_size), "--seq-len",
                   str(args.seq_len), "--steps", str(args.steps), "--warmup", str(args.warmup)]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            results[(tenants, mode)] = json.loads(out.strip().splitlines()[-1])
            print(f"  {tenants} tenants {mode:17s} {results[(tenants, mode)]['tokens_per_s']:8.1f} tokens/s", flush=True)
    print(f"\n{args.backend}, {args.precision}, LoRA r=8 all-linear per tenant, {args.batch_size}x{args.seq_len} "
          f"tokens per tenant per step, {args.steps} measured rounds")
    print("| tenants | one after another tok/s | mixed batch tok/s | speed-up | peak memory MB (after / mixed) |")
    print("|---|---|---|---|---|")
    for tenants in map(int, args.tenants.split(",")):
        seq, mixed = results[(tenants, "one-after-another")], results[(tenants, "mixed")]
        print(f"| {tenants} | {seq['tokens_per_s']:.1f} | {mixed['tokens_per_s']:.1f} | "
              f"{mixed['tokens_per_s'] / seq['tokens_per_s']:.2f}x | {seq['peak_memory_mb']:.0f} / "
              f"{mixed['peak_memory_mb']:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
