"""Megatron on one H100/H200: the local spec vs Transformer Engine in bf16 and fp8, MFU, and a TE round trip.

    bash bench/gpu_megatron.sh run                      # on a lent H200: installs the wheels, then this
    python bench/gpu_megatron.py --out DIR              # where megatron-core and Transformer Engine import

1. Writes a Qwen2.5-shaped model with random weights (bf16 safetensors; ~1.0B parameters by default).
2. Trains it in one fresh process per case, all on the same fixed batches (--rows rows of --seq-len tokens,
   shifted copies of one repeating 256-token pattern: learnable, so the losses compare learning):
   local-bf16 (megatron's local spec), te-bf16, te-fp8-delayed and te-fp8-tensorwise (Transformer Engine,
   fp8 with its delayed and current scaling recipes). Each reports tokens/s over the steps after --warmup,
   MFU against the dense bf16 peak (989 TFLOP/s, twinkle_core.perf's FLOP count), peak GPU memory and the
   loss after --steps steps; the losses must lie within 2% of local-bf16's.
3. Round trip: HF -> MegatronModel on the TE spec -> HF, every tensor compared exactly.
4. Runs the Transformers backend's bench/gpu_precision.py on the same model and batches, for the ratio.
Prints one table and writes results.json and table.txt to --out (default $OUT, else bench-out/).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PEAK_BF16 = 989e12  # H100/H200 SXM dense bf16 tensor-core peak (the yardstick, fp8 runs included)
CASES = {  # name: MegatronModel options
    "local-bf16": dict(transformer_impl="local", mixed_precision="bf16"),
    "te-bf16": dict(transformer_impl="transformer_engine", mixed_precision="bf16"),
    "te-fp8-delayed": dict(transformer_impl="transformer_engine", mixed_precision="fp8", fp8_recipe="delayed"),
    "te-fp8-tensorwise": dict(transformer_impl="transformer_engine", mixed_precision="fp8",
                              fp8_recipe="tensorwise"),
}
LOSS_TOLERANCE = 0.02


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT") or "bench-out", help="where results go")
    parser.add_argument("--work", default="/tmp/twinkle-gpu-megatron", help="model directories")
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps per case (the loss is the last)")
    parser.add_argument("--warmup", type=int, default=5, help="steps before the timing starts")
    parser.add_argument("--rows", type=int, default=2, help="sequences per step")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--layers", type=int, default=9)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--ffn", type=int, default=11008)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--budget-s", type=float, default=420, help="skip what would start after this long")
    parser.add_argument("--skip-transformers", action="store_true", help="do not run bench/gpu_precision.py")
    parser.add_argument("--case", help=argparse.SUPPRESS)  # internal: run one case in this process
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


# ----- the model and the batches ----------------------------------------------------------------------------
def write_model(args, directory: Path) -> Path:
    """A Qwen2.5-shaped checkpoint with random bf16 weights and a small tokenizer (none is reachable offline)."""
    import torch
    from tokenizers import Tokenizer, models
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen2Config

    if (directory / "config.json").is_file():
        return directory
    config = Qwen2Config(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.ffn,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.kv_heads, max_position_embeddings=max(32768, args.seq_len),
                         rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=0,
                         eos_token_id=1, pad_token_id=1)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(directory)
    words = {"<|endoftext|>": 0, "<|im_end|>": 1, "<unk>": 2}  # only ids are trained; the tokenizer is a formality
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(words, unk_token="<unk>")),
                                        eos_token="<|im_end|>", pad_token="<|im_end|>", unk_token="<unk>")
    tokenizer.save_pretrained(directory)
    del model
    torch.cuda.empty_cache()
    return directory


def fixed_batches(args) -> list[dict]:
    """gpu_precision.py's batches: rows are shifted copies of one repeating 256-token pattern."""
    import torch

    gen = torch.Generator().manual_seed(0)
    pattern = torch.randint(0, args.vocab, (256,), generator=gen).repeat(args.seq_len // 256 + 2)
    batches = []
    for _ in range(args.steps):
        offsets = torch.randint(0, 256, (args.rows,), generator=gen)
        ids = torch.stack([pattern[o:o + args.seq_len] for o in offsets.tolist()])
        batches.append({"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)})
    return batches


# ----- one case, in its own process -------------------------------------------------------------------------
def run_case(args) -> dict:
    import torch
    from transformers import AutoConfig

    from twinkle_core.models import MegatronModel
    from twinkle_core.perf import mfu, model_flops_per_token

    options = CASES[args.case]
    torch.cuda.reset_peak_memory_stats()
    model = MegatronModel(args.model_dir, seed=0, **options)
    model.set_optimizer("AdamW", lr=args.lr)
    losses, start = [], None
    for step, batch in enumerate(fixed_batches(args)):
        if step == args.warmup:
            torch.cuda.synchronize()
            start = time.perf_counter()
        model.forward_backward(inputs=batch)
        model.clip_grad_and_step(max_grad_norm=1.0)
        losses.append(model.calculate_metric()["loss"])
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    tokens_per_s = (args.steps - args.warmup) * args.rows * args.seq_len / seconds
    flops = model_flops_per_token(AutoConfig.from_pretrained(args.model_dir), args.seq_len)
    names = [name for chunk in model.chunks for name, _ in chunk.named_parameters()]
    return {"case": args.case, "transformer_impl": model.transformer_impl, "tokens_per_s": tokens_per_s,
            "mfu": mfu(tokens_per_s, flops, PEAK_BF16), "peak_memory_gb": torch.cuda.max_memory_allocated() / 2**30,
            "loss": losses[-1], "losses": losses, "flops_per_token": flops,
            "te_fused_norm_names": sum(name.endswith("layer_norm_weight") for name in names)}


def run_round_trip(args) -> dict:
    """HF -> MegatronModel (TE spec) -> HF: every tensor equal, and the TE spec's fused names in use."""
    import torch
    from safetensors.torch import load_file

    from twinkle_core.models import MegatronModel

    model = MegatronModel(args.model_dir, mixed_precision="bf16", transformer_impl="transformer_engine")
    fused = [n for chunk in model.chunks for n, _ in chunk.named_parameters() if n.endswith("layer_norm_weight")]
    out = Path(args.work) / "round-trip"
    model.save_hf(out)

    def tensors(directory: Path) -> dict:
        found = {}
        for file in sorted(directory.glob("*.safetensors")):
            found.update(load_file(file))
        return found

    before, after = tensors(Path(args.model_dir)), tensors(out)
    unequal = sorted(n for n in before.keys() & after.keys() if not torch.equal(before[n], after[n]))
    missing, extra = sorted(before.keys() - after.keys()), sorted(after.keys() - before.keys())
    return {"case": "round-trip", "transformer_impl": model.transformer_impl, "tensors": len(before),
            "unequal": unequal[:8], "missing": missing[:8], "extra": extra[:8], "fused_norm_params": len(fused),
            "exact": not (unequal or missing or extra) and len(fused) > 0}


def one_case_main(args) -> int:
    sys.path.insert(0, str(REPO))
    result = run_round_trip(args) if args.case == "round-trip" else run_case(args)
    Path(args.result).write_text(json.dumps(result) + "\n")
    return 0


# ----- the driver ----------------------------------------------------------------------------------------------
def spawn_case(args, name: str, model_dir: Path, results: Path, timeout: float) -> dict:
    result = results / f"{name}.json"
    command = [sys.executable, __file__, "--case", name, "--model-dir", str(model_dir), "--result", str(result),
               "--work", args.work, "--steps", str(args.steps), "--warmup", str(args.warmup), "--rows",
               str(args.rows), "--seq-len", str(args.seq_len), "--lr", str(args.lr), "--vocab", str(args.vocab)]
    started = time.perf_counter()
    try:
        done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"case": name, "error": f"timed out after {timeout:.0f} s"}
    if done.returncode or not result.is_file():
        tail = (done.stdout + done.stderr).strip().splitlines()[-12:]
        return {"case": name, "error": f"exit {done.returncode}: " + " | ".join(tail)}
    return {**json.loads(result.read_text()), "wall_s": time.perf_counter() - started}


def run_transformers(args, model_dir: Path, timeout: float) -> dict:
    """bench/gpu_precision.py on the same model and batch shape (fp8 there needs torchao)."""
    import importlib.util

    precisions = "bf16,fp8" if importlib.util.find_spec("torchao") else "bf16"
    command = [sys.executable, str(REPO / "bench" / "gpu_precision.py"), "--model-dir", str(model_dir),
               "--steps", str(args.steps), "--warmup", str(args.warmup), "--batch-size", str(args.rows),
               "--seq-len", str(args.seq_len), "--precisions", precisions]
    try:
        done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode or not rows:
        return {"error": f"exit {done.returncode}: " + " | ".join((done.stdout + done.stderr).splitlines()[-12:])}
    return {"rows": rows, "output": done.stdout}


def table(results: list[dict], transformers: dict, round_trip: dict) -> list[str]:
    reference = next((r["loss"] for r in results if r.get("case") == "local-bf16" and "loss" in r), None)
    lines = [f"{'case':<20} {'tokens/s':>10} {'MFU':>7} {'peak GB':>8} {'loss@end':>9} {'vs local':>9}"]
    for r in results:
        if "error" in r:
            lines.append(f"{r['case']:<20} not run: {r['error']}")
            continue
        gap = abs(r["loss"] - reference) / reference if reference else float("nan")
        lines.append(f"{r['case']:<20} {r['tokens_per_s']:>10.0f} {r['mfu']:>7.1%} {r['peak_memory_gb']:>8.1f} "
                     f"{r['loss']:>9.4f} {gap:>9.2%}")
    for row in transformers.get("rows", []):
        lines.append(f"{'transformers-' + row['precision']:<20} {row['tokens_per_s']:>10.0f} "
                     f"{row['mfu_vs_bf16_peak']:>7.1%} {row['peak_memory_gb']:>8.1f} {row['final_loss']:>9.4f}")
    if "error" in transformers:
        lines.append(f"{'transformers':<20} not run: {transformers['error']}")
    lines += checks(results, transformers, round_trip, reference)
    return lines


def checks(results: list[dict], transformers: dict, round_trip: dict, reference: float | None) -> list[str]:
    ran = {r["case"]: r for r in results if "error" not in r}
    lines = []
    if reference is not None and len(ran) > 1:
        gaps = {name: abs(r["loss"] - reference) / reference for name, r in ran.items()}
        worst = max(gaps, key=gaps.get)
        lines.append(f"check losses within {LOSS_TOLERANCE:.0%} of local-bf16: "
                     f"{'PASS' if gaps[worst] <= LOSS_TOLERANCE else 'FAIL'} (largest: {worst}, {gaps[worst]:.2%})")
    if "te-bf16" in ran:
        mfu = ran["te-bf16"]["mfu"]
        lines.append(f"check TE bf16 MFU >= 45%: {'PASS' if mfu >= 0.45 else 'FAIL'} ({mfu:.1%})")
        fp8 = [name for name in ran if "fp8" in name]
        for name in fp8:
            ratio = ran[name]["tokens_per_s"] / ran["te-bf16"]["tokens_per_s"]
            lines.append(f"check {name} faster than te-bf16: {'PASS' if ratio > 1 else 'FAIL'} ({ratio:.2f}x)")
        bf16 = [row for row in transformers.get("rows", []) if row["precision"] == "bf16"]
        if bf16:
            lines.append(f"megatron te-bf16 / transformers bf16 tokens/s: "
                         f"{ran['te-bf16']['tokens_per_s'] / bf16[0]['tokens_per_s']:.2f}x")
    if round_trip:
        if "error" in round_trip:
            lines.append(f"check HF -> Megatron(TE) -> HF exact: not run: {round_trip['error']}")
        else:
            lines.append(f"check HF -> Megatron(TE) -> HF exact: {'PASS' if round_trip['exact'] else 'FAIL'} "
                         f"({round_trip['tensors']} tensors, {round_trip['fused_norm_params']} TE fused-norm "
                         f"parameters; unequal {round_trip['unequal']}, missing {round_trip['missing']}, "
                         f"extra {round_trip['extra']})")
    return lines


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.case:
        return one_case_main(args)
    started = time.perf_counter()
    sys.path.insert(0, str(REPO))
    unknown = [name for name in args.cases.split(",") if name and name not in CASES]
    if unknown:
        raise SystemExit(f"--cases: unknown {unknown}; choose from {', '.join(CASES)}.")
    out, work = Path(args.out), Path(args.work)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    model_dir = write_model(args, work / "model")
    print(f"model ready in {time.perf_counter() - started:.0f} s: {model_dir}", flush=True)

    def left() -> float:
        return args.budget_s - (time.perf_counter() - started)

    results = []
    for name in [n for n in args.cases.split(",") if n]:
        if left() < 30:
            results.append({"case": name, "error": "skipped: the time budget is spent"})
            continue
        results.append(spawn_case(args, name, model_dir, work, timeout=left()))
        print(json.dumps({k: v for k, v in results[-1].items() if k != "losses"}), flush=True)
    round_trip = spawn_case(args, "round-trip", model_dir, work, timeout=max(1.0, left())) if left() > 20 else \
        {"error": "skipped: the time budget is spent"}
    print(json.dumps(round_trip), flush=True)
    transformers = {} if args.skip_transformers else run_transformers(args, model_dir, timeout=max(1.0, left())) \
        if left() > 30 else {"error": "skipped: the time budget is spent"}
    lines = table(results, transformers, round_trip)
    header = (f"Qwen2.5-shaped, random weights: {args.layers} layers, hidden {args.hidden}, ffn {args.ffn}, "
              f"heads {args.heads}/{args.kv_heads}, vocab {args.vocab}; {args.rows} x {args.seq_len} tokens per "
              f"step, {args.steps} steps ({args.warmup} warm-up); MFU vs 989 TFLOP/s; "
              f"{time.perf_counter() - started:.0f} s in all")
    text = "\n".join([header, *lines])
    print(text, flush=True)
    (out / "table.txt").write_text(text + "\n")
    (out / "results.json").write_text(json.dumps({"cases": results, "round_trip": round_trip,
                                                  "transformers": transformers, "args": vars(args)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
