"""Vision-language training throughput and memory: TransformersModel (vision_lm) vs HF Trainer, Qwen2.5-VL.

    python bench/bench_vision.py                       # 50 measured steps of 8 rows after 5, 3 repeats each
    python bench/bench_vision.py --steps 3 --warmup 1 --repeats 1
    python bench/bench_vision.py --model-id ms://Qwen/Qwen2.5-VL-3B-Instruct --max-pixels 200704

Two trainings, each on both sides:

- lora: LoRA r=8, alpha 16, dropout 0 on every linear layer of the language model; the vision tower and
  the merger frozen (the vision_lm defaults);
- full: every weight trains, the vision tower and the merger too (freeze_vision=False, freeze_aligner=False).

Both sides train the same checkpoint (by default a tiny random Qwen2.5-VL of the real class, the one the tests
build: 2 text layers of hidden 64, a 1-block vision tower; `--model-id` for a real one) in fp32 with fused
AdamW (lr 1e-4, weight decay 0.01, constant, no warm-up, grad-norm clip 1.0) on the same collated batches in
the same order: the bundled vision_shapes rows (twinkle_core/datasets/vision_shapes/train.jsonl, in file
order, 162 one-picture rows and 8 one-video rows, repeated as needed), encoded and collated once by
twinkle_core.data in the parent process and loaded by each run, `--batch-size` rows per step, pictures at
`--max-pixels` (112x112 by default: 16 image tokens).

- ours: `TransformersModel(objective="vision_lm", objective_options=...)`, `forward_backward(batch)` then
  `clip_grad_and_step(1.0)`;
- HF: `transformers.Trainer` on `AutoModelForImageTextToText` of the same folder (PEFT's `get_peft_model` with
  the same LoRA, the vision tower's and merger's linears excluded as ours excludes them), fed our collated
  batches by a one-batch-per-item dataset and a collator that returns the item; its loss is the model's own
  (logits at every position).

Each (side, training) runs in its own process (peak RSS is that run's own: VmHWM), the runs alternate the
sides `--repeats` times, and the table shows medians. rows/s is the rows of a step over the median time of
the measured steps (forward, backward, clip, optimizer step; the `--warmup` steps before are not measured):
on a shared machine the median step is steadier than their sum. Each run's JSON line keeps every step's time
and the rows/s of their sum too.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DATASET = ROOT / "twinkle_core" / "datasets" / "vision_shapes" / "train.jsonl"
LORA = dict(r=8, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear")
TRAININGS = {"lora": {}, "full": {"freeze_vision": False, "freeze_aligner": False}}  # our objective options
LR, WEIGHT_DECAY = 1e-4, 0.01
RESULT_PREFIX = "BENCH_VISION "
RUN_TIMEOUT_S = 900


def peak_rss_mb() -> float:
    """This process's peak RSS (VmHWM: it resets at exec, unlike ru_maxrss)."""
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def encode_batches(model_dir: str, args) -> list[dict]:
    """`steps + warmup` collated batches of the data file's rows in order (repeated as needed)."""
    from transformers import AutoTokenizer

    from twinkle_core.data import get_row_format

    row_format = get_row_format("vision_chat")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    encoder = row_format.load_encoder(tokenizer, model_dir)
    lines = [json.loads(line) for line in args.data.read_text().splitlines() if line.strip()]
    count = (args.steps + args.warmup) * args.batch_size
    options = {"min_pixels": args.min_pixels, "max_pixels": args.max_pixels}
    examples = [row_format.encode(encoder, row_format.check(lines[i % len(lines)], args.data.parent), **options)
                for i in range(count)]
    return [row_format.collate(examples[i:i + args.batch_size], pad_token_id=tokenizer.pad_token_id)
            for i in range(0, count, args.batch_size)]


def sync() -> None:
    import torch

    if torch.cuda.is_available():  # a GPU step is timed when its kernels are done
        torch.cuda.synchronize()


def trainable(model) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def run_ours(model_dir: str, training: str, data: list[dict]) -> tuple[list[float], list[float], int]:
    import torch
    from peft import LoraConfig

    from twinkle_core.models import TransformersModel

    model = TransformersModel(model_dir, mixed_precision="no", objective="vision_lm",
                              objective_options=TRAININGS[training])
    if training == "lora":
        torch.manual_seed(0)  # the LoRA A init, as on the HF side
        model.add_adapter_to_model("default", LoraConfig(**LORA))
    model.set_optimizer("AdamW", lr=LR, weight_decay=WEIGHT_DECAY)
    seconds, losses = [], []
    for batch in data:
        start = time.perf_counter()
        losses.append(float(model.forward_backward(batch)))
        model.clip_grad_and_step(max_grad_norm=1.0)
        sync()
        seconds.append(time.perf_counter() - start)
    return seconds, losses, trainable(model.model)


def run_hf(model_dir: str, training: str, data: list[dict]) -> tuple[list[float], list[float], int]:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForImageTextToText, Trainer, TrainingArguments
    from hf_clock import StepClock

    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    if training == "lora":
        vision = [name for name, module in model.named_modules()
                  if isinstance(module, torch.nn.Linear) and name.startswith("model.visual.")]
        torch.manual_seed(0)
        model = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", exclude_modules=vision, **LORA))
    losses = []

    clock = StepClock(sync)  # the begin and end of every step

    class Recorded(Trainer):
        def training_step(self, model_, inputs, *rest, **kw):
            loss = super().training_step(model_, inputs, *rest, **kw)
            losses.append(float(loss))
            return loss

    with tempfile.TemporaryDirectory(prefix="bench-vision-hf-") as output_dir:
        config = TrainingArguments(
            output_dir=output_dir, per_device_train_batch_size=1, max_steps=len(data), learning_rate=LR,
            lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=1.0, optim="adamw_torch_fused",
            weight_decay=WEIGHT_DECAY, use_cpu=not torch.cuda.is_available(), report_to="none", save_strategy="no",
            eval_strategy="no", logging_strategy="no", disable_tqdm=True, dataloader_num_workers=0, seed=0,
            remove_unused_columns=False, train_sampling_strategy="sequential")
        # One item is one of our collated batches; the collator hands it over as it is.
        trainer = Recorded(model=model, args=config, train_dataset=data, data_collator=lambda items: items[0],
                           callbacks=[clock])
        trainer.train()
    return clock.step_seconds, losses, trainable(model)


def one(args) -> None:
    """Measure one (side, training) in this process and print its result line."""
    import torch

    torch.set_num_threads(args.threads)
    side, training = args.one.split(":")
    data = torch.load(args.batches, weights_only=True)
    runner = run_ours if side == "ours" else run_hf
    seconds, losses, params = runner(args.model_dir, training, data)
    measured = seconds[args.warmup:]
    step = statistics.median(measured)
    print(RESULT_PREFIX + json.dumps({
        "run": args.one, "rows_per_s": args.batch_size / step, "s_per_step": step,
        "rows_per_s_summed": args.steps * args.batch_size / sum(measured), "step_seconds": measured,
        "first_loss": losses[0], "last_loss": losses[-1], "peak_rss_mb": peak_rss_mb(), "trainable": params,
        "image_tokens": int(sum((b["mm_token_type_ids"] > 0).sum() for b in data[args.warmup:]))}), flush=True)


def run_child(run: str, model_dir: str, batches: Path, args) -> dict:
    cmd = [sys.executable, __file__, "--one", run, "--model-dir", model_dir, "--batches", str(batches),
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--batch-size", str(args.batch_size),
           "--threads", str(args.threads)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(args.threads),
           "MKL_NUM_THREADS": str(args.threads), "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=RUN_TIMEOUT_S)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-4000:]}")
    line = next(l for l in reversed(proc.stdout.splitlines()) if l.startswith(RESULT_PREFIX))
    return json.loads(line[len(RESULT_PREFIX):])


def model_folder(args, scratch: Path) -> str:
    """The checkpoint both sides load: `--model-id` resolved, or the tests' tiny Qwen2.5-VL written to scratch."""
    if args.model_id:
        from twinkle_core.hub import resolve_model

        return str(resolve_model(args.model_id).path)
    sys.path.insert(0, str(ROOT / "tests"))
    from vision_models import save_tiny_qwen2_5_vl

    return str(save_tiny_qwen2_5_vl(scratch / "tiny-qwen2.5-vl"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-id", help="a Qwen2.5-VL checkpoint (default: a tiny random one)")
    parser.add_argument("--data", type=Path, default=DATASET, help="vision_chat rows (default: vision_shapes)")
    parser.add_argument("--steps", type=int, default=50, help="measured optimizer steps")
    parser.add_argument("--warmup", type=int, default=5, help="unmeasured steps first")
    parser.add_argument("--batch-size", type=int, default=8, help="rows per optimizer step")
    parser.add_argument("--min-pixels", type=int, default=112 * 112)
    parser.add_argument("--max-pixels", type=int, default=112 * 112)
    parser.add_argument("--repeats", type=int, default=3, help="runs per (side, training), alternating sides")
    parser.add_argument("--threads", type=int, default=2, help="torch threads in each run")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--batches", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        one(args)
        return 0
    load_before = os.getloadavg()[0]  # other processes on the machine skew the timings: say how busy it was
    runs = [f"{side}:{training}" for training in TRAININGS for side in ("ours", "hf")]
    results: dict[str, list[dict]] = {run: [] for run in runs}
    with tempfile.TemporaryDirectory(prefix="bench-vision-") as scratch:
        model_dir = model_folder(args, Path(scratch))
        import torch

        batches = Path(scratch) / "batches.pt"  # encoded once: both sides load the very same tensors
        torch.save(encode_batches(model_dir, args), batches)
        for repeat in range(args.repeats):
            for training in TRAININGS:
                for side in ("ours", "hf") if repeat % 2 == 0 else ("hf", "ours"):
                    r = run_child(f"{side}:{training}", model_dir, batches, args)
                    results[r["run"]].append(r)
                    print(f"  repeat {repeat + 1} {r['run']:10s} {r['rows_per_s']:8.2f} rows/s "
                          f"{r['s_per_step']:.3f} s/step {r['peak_rss_mb']:6.0f} MB  "
                          f"loss {r['first_loss']:.4f} -> {r['last_loss']:.4f}", flush=True)
    keys = ("rows_per_s", "s_per_step", "peak_rss_mb", "first_loss", "last_loss", "image_tokens", "trainable")
    med = {run: {key: statistics.median(r[key] for r in found) for key in keys} for run, found in results.items()}
    print(f"\nQwen2.5-VL {'(' + args.model_id + ')' if args.model_id else '(tiny, random)'}, fp32, "
          f"{args.batch_size} rows per step, pictures at <= {args.max_pixels} pixels, {args.steps} measured steps "
          f"after {args.warmup}, {args.threads} threads, median of {args.repeats} runs each; load average "
          f"{load_before:.1f} before, {os.getloadavg()[0]:.1f} after ({os.cpu_count()} CPUs)")
    print("| training | trainer | trained weights | rows/s | s/step | peak RSS MB | loss first -> last |")
    print("|---|---|---|---|---|---|---|")
    for run in runs:
        m, (side, training) = med[run], run.split(":")
        print(f"| {training} | {'Twinkle Flows' if side == 'ours' else 'HF Trainer'} | {m['trainable']:,.0f} | "
              f"{m['rows_per_s']:.2f} | "
              f"{m['s_per_step']:.3f} | {m['peak_rss_mb']:.0f} | {m['first_loss']:.4f} -> {m['last_loss']:.4f} |")
    for training in TRAININGS:
        ours, hf = med[f"ours:{training}"], med[f"hf:{training}"]
        print(f"{training}: ours/HF rows/s {ours['rows_per_s'] / hf['rows_per_s']:.2f}x, "
              f"peak RSS {ours['peak_rss_mb'] / hf['peak_rss_mb']:.2f}x")
    print(json.dumps({"benchmark": "vision", "args": {k: str(v) for k, v in vars(args).items()}, "median": med,
                      "runs": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
