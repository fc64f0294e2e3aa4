"""Embedding training throughput: TransformersModel (infonce) vs sentence-transformers' trainer + MNRL.

    python bench/bench_embedding.py                                  # 20 steps of 32 triples, 3 repeats
    python bench/bench_embedding.py --steps 8 --repeats 1 --batch-size 16
    python bench/bench_embedding.py --profile                        # + cProfile of one of our runs

Both sides fully fine-tune the default embedding model (all-MiniLM-L6-v2: BERT, mean pooling, normalised)
in fp32 with AdamW (lr 2e-5, constant, no warm-up, grad-norm clip 1.0) on the same (query, positive, first
hard negative) triples, in the same order, `--batch-size` rows per optimizer step, every text cut to
`--max-length` tokens, with `--threads` torch threads:

- ours: `TransformersModel(objective="infonce", temperature=0.05)`, `forward_backward` on batches
  tokenised and collated before the clock starts (twinkle_core.data.pairs), then `clip_grad_and_step`;
- sentence-transformers: `SentenceTransformerTrainer` with `MultipleNegativesRankingLoss(scale=20)` (the same
  loss: cos-sim x 20 = q.d / 0.05), columns anchor / positive / negative, no eval, no saving; its
  default batch sampler class (DefaultBatchSampler) over the dataset in order instead of shuffled, so both
  sides see identical batches. Its collator tokenises each batch on the fly, as the trainer does.

Each run is its own process (neither warms the other; peak RSS is that run's own), the runs alternate
ours / theirs `--repeats` times, and the table shows medians. tokens/s counts the non-padding tokens of
every text (query + positive + negative) of the measured steps, counted on the tensors each side actually
trained on, over the summed time of those steps (forward, backward, clip, optimizer step; the
`--warmup` steps before are not measured). "incl. data" is the wall time from the end of the last
warm-up step to the end of the last step: it also holds fetching and collating the batches (where
sentence-transformers tokenises, and ours only indexes a list). Data: the bundled retrieval set
(twinkle_core/datasets/retrieval/train.jsonl) when it exists, else a deterministic synthetic set of the
same layout written to a temp folder.
"""
from __future__ import annotations

import argparse
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

DEFAULT_MODEL = "pkg://all_minilm_l6_v2/model.zip"
DATASET = ROOT / "twinkle_core" / "datasets" / "retrieval" / "train.jsonl"
LR = 2e-5
TEMPERATURE = 0.05  # MNRL scale 20 = 1 / 0.05
RESULT_PREFIX = "BENCH_EMBEDDING "
RUNNERS = {"twinkle": "TransformersModel", "sentence_transformers": "sentence-transformers"}
RUN_TIMEOUT_S = 900

WORDS = ("river mountain village harbour market bridge tower garden forest meadow island valley castle "
         "library museum school station factory farm orchard vineyard lake canal street square festival "
         "winter summer spring autumn morning evening night lantern kite boat drum candle cheese bread "
         "copper glass wooden silver woollen iron clay linen leather honey apple pear cider fish salt "
         "baker weaver painter sailor farmer miller doctor teacher singer inventor engineer merchant "
         "builds sells paints sings grows repairs carries opens closes celebrates remembers discovers "
         "old new small large quiet busy bright dark green blue red golden northern southern eastern "
         "western famous hidden ancient modern every each many few some most during after before near").split()


# ----- data ---------------------------------------------------------------------------------------
def synthetic_rows(count: int = 256, seed: int = 0) -> list[dict]:
    """Deterministic (query ~10 words, positive ~25 words, one negative ~25 words) rows, all texts distinct."""
    rng = random.Random(seed)
    rows, seen = [], set()
    while len(rows) < count:
        query = " ".join(rng.choices(WORDS, k=rng.randint(8, 12))) + "?"
        # The positive shares a few of the query's words; the negative is about something else.
        positive = " ".join(rng.sample(query[:-1].split(), 3) + rng.choices(WORDS, k=rng.randint(19, 25))) + "."
        negative = " ".join(rng.choices(WORDS, k=rng.randint(22, 28))) + "."
        if {query, positive, negative} & seen or positive == negative:
            continue
        seen |= {query, positive, negative}
        rows.append({"query": query, "positive": positive, "negatives": [negative]})
    return rows


def resolve_data(path: Path | None) -> tuple[Path, str]:
    """The jsonl to train on and a description: --data, else the bundled set, else a synthetic one."""
    if path is not None:
        return path, str(path)
    if DATASET.exists():
        return DATASET, str(DATASET.relative_to(ROOT))
    rows = synthetic_rows()
    target = Path(tempfile.mkdtemp(prefix="bench-embedding-")) / "train.jsonl"
    target.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return target, f"synthetic, {len(rows)} rows"


def triples(path: Path, count: int) -> list[dict]:
    """`count` rows {"query", "positive", "negatives": [first hard negative]}, the file's rows in order and
    repeated as needed; rows without a hard negative are skipped (sentence-transformers needs equal columns)."""
    from twinkle_core.data.pairs import validate_pair_row

    rows = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        row = validate_pair_row(json.loads(line))
        if row["negatives"]:
            rows.append({"query": row["query"], "positive": row["positives"][0], "negatives": row["negatives"][:1]})
    if not rows:
        raise SystemExit(f"{path}: no row has a hard negative")
    return [rows[i % len(rows)] for i in range(count)]


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


def summary(step_seconds: list[float], step_tokens: list[int], span: float, warmup: int, losses: list[float]) -> dict:
    """tokens/s and s/step over the measured steps (those after the warm-up)."""
    seconds, tokens = sum(step_seconds[warmup:]), sum(step_tokens[warmup:])
    steps = len(step_seconds) - warmup
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds, "s_per_step": seconds / steps,
            "tokens_per_s_incl_data": tokens / span, "first_loss": losses[0], "last_loss": losses[-1]}


def run_ours(path: str, rows: list[dict], args, profile: bool = False) -> dict:
    from twinkle_core.data.pairs import collate_pairs, encode_pair_row, truncate_pair, validate_pair_row
    from twinkle_core.models import TransformersModel

    import torch

    torch.manual_seed(0)  # the same dropout masks in every repeat (the trainer seeds itself with seed=0)
    model = TransformersModel(path, objective="infonce", mixed_precision="no",
                              objective_options={"temperature": TEMPERATURE})
    model.set_optimizer("AdamW", lr=LR)
    tokenizer = model.tokenizer
    examples = [truncate_pair(encode_pair_row(tokenizer, validate_pair_row(row))[0], args.max_length) for row in rows]
    batches = [collate_pairs(examples[i:i + args.batch_size], tokenizer.pad_token_id)
               for i in range(0, len(examples), args.batch_size)]
    step_tokens = [int(b["query_attention_mask"].sum() + b["doc_attention_mask"].sum()) for b in batches]
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
            pstats.Stats(profiler, stream=out).sort_stats(sort).print_stats(25)
            print(f"--- cProfile of ours, measured steps, by {sort} ---\n{out.getvalue()}", file=sys.stderr)
    return summary(step_seconds, step_tokens, span, args.warmup, losses)


def run_sentence_transformers(path: str, rows: list[dict], args) -> dict:
    import torch
    from torch.utils.data import SequentialSampler

    from sentence_transformers import SentenceTransformer, SentenceTransformerTrainer, SentenceTransformerTrainingArguments
    from hf_clock import StepClock
    try:
        from sentence_transformers.base.sampler import DefaultBatchSampler
        from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss
    except ImportError:  # sentence-transformers < 6
        from sentence_transformers.losses import MultipleNegativesRankingLoss
        from sentence_transformers.sampler import DefaultBatchSampler
    try:
        from datasets import Dataset
    except ImportError as exc:
        raise SystemExit("sentence-transformers' trainer needs the `datasets` package; install it") from exc

    model = SentenceTransformer(path, device="cuda" if torch.cuda.is_available() else "cpu")
    model.max_seq_length = args.max_length
    loss = MultipleNegativesRankingLoss(model, scale=1.0 / TEMPERATURE)
    step_tokens, losses = [], []
    # The tokens each step trained on: non-padding tokens of every column's features, as the loss sees them.
    loss.register_forward_pre_hook(
        lambda module, inputs: step_tokens.append(sum(int(f["attention_mask"].sum()) for f in inputs[0])))
    loss.register_forward_hook(lambda module, inputs, output: losses.append(float(output.detach())))

    clock = StepClock(sync)  # the begin and end of every step

    def in_order(dataset, batch_size, drop_last, valid_label_columns=None, generator=None, seed=0):
        """The default batch sampler class (BatchSamplers.BATCH_SAMPLER) without its shuffling."""
        return DefaultBatchSampler(SequentialSampler(range(len(dataset))), batch_size=batch_size, drop_last=drop_last,
                                   valid_label_columns=valid_label_columns, generator=generator, seed=seed)

    dataset = Dataset.from_dict({"anchor": [r["query"] for r in rows], "positive": [r["positive"] for r in rows],
                                 "negative": [r["negatives"][0] for r in rows]})
    with tempfile.TemporaryDirectory(prefix="bench-st-") as output_dir:
        training_args = SentenceTransformerTrainingArguments(
            output_dir=output_dir, per_device_train_batch_size=args.batch_size, max_steps=len(rows) // args.batch_size,
            learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=1.0, optim="adamw_torch",
            weight_decay=0.01,  # torch.optim.AdamW's default, which ours uses
            bf16=False, fp16=False, use_cpu=not torch.cuda.is_available(), report_to="none", save_strategy="no",
            eval_strategy="no", logging_strategy="no", disable_tqdm=True, dataloader_drop_last=True,
            dataloader_num_workers=0, seed=0, batch_sampler=in_order,
        )
        trainer = SentenceTransformerTrainer(model=model, args=training_args, train_dataset=dataset, loss=loss,
                                             callbacks=[clock])
        trainer.train()
    step_seconds = clock.step_seconds
    span = clock.ends[-1] - (clock.ends[args.warmup - 1] if args.warmup else clock.begins[0])
    return summary(step_seconds, step_tokens, span, args.warmup, losses)


def one(args) -> None:
    """Measure one runner in this process and print its result line."""
    import torch

    torch.set_num_threads(args.threads)
    from twinkle_core.hub import resolve_model

    path = str(resolve_model(args.model_id).path)
    rows = triples(args.data, (args.steps + args.warmup) * args.batch_size)
    if args.one == "twinkle":
        result = run_ours(path, rows, args, profile=args.profile)
    else:
        result = run_sentence_transformers(path, rows, args)
    result.update(runner=args.one, threads=torch.get_num_threads(), **peak_memory_mb())
    print(RESULT_PREFIX + json.dumps(result), flush=True)


def run_child(runner: str, args, data: Path, profile: bool = False) -> dict:
    cmd = [sys.executable, __file__, "--one", runner, "--data", str(data), "--model-id", args.model_id,
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
    parser.add_argument("--data", type=Path, default=None, help="jsonl of {query, positive, negatives} rows "
                        "(default: the bundled retrieval set, else a synthetic one)")
    parser.add_argument("--steps", type=int, default=20, help="measured optimizer steps")
    parser.add_argument("--warmup", type=int, default=2, help="unmeasured steps first")
    parser.add_argument("--batch-size", type=int, default=32, help="triples per optimizer step")
    parser.add_argument("--max-length", type=int, default=128, help="tokens per text (each cut on its own)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per side, alternating")
    parser.add_argument("--threads", type=int, default=2, help="torch threads in each run")
    parser.add_argument("--profile", action="store_true", help="also cProfile one of our runs (not timed)")
    parser.add_argument("--one", choices=sorted(RUNNERS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        one(args)
        return 0
    data, described = resolve_data(args.data)
    results: dict[str, list[dict]] = {name: [] for name in RUNNERS}
    for repeat in range(args.repeats):
        order = ("twinkle", "sentence_transformers") if repeat % 2 == 0 else ("sentence_transformers", "twinkle")
        for runner in order:
            r = run_child(runner, args, data)
            results[runner].append(r)
            print(f"  repeat {repeat + 1} {RUNNERS[runner]:22s} {r['tokens_per_s']:8.1f} tokens/s "
                  f"{r['s_per_step']:.3f} s/step  loss {r['first_loss']:.3f} -> {r['last_loss']:.3f}", flush=True)

    med = {name: {key: statistics.median(r[key] for r in runs) for key in
                  ("tokens_per_s", "s_per_step", "tokens_per_s_incl_data", "peak_rss_mb", "tokens")}
           for name, runs in results.items()}
    ours, theirs = med["twinkle"], med["sentence_transformers"]
    ratio = ours["tokens_per_s"] / theirs["tokens_per_s"]
    print(f"\nfull fine-tuning, fp32, {args.batch_size} (query, positive, negative) triples per step, <= "
          f"{args.max_length} tokens per text, {args.steps} measured steps after {args.warmup}, "
          f"{args.threads} threads, median of {args.repeats} runs each; data: {described}")
    print("| trainer | tokens/s | s/step | tokens/s incl. data | peak RSS MB | tokens measured |")
    print("|---|---|---|---|---|---|")
    for name in ("sentence_transformers", "twinkle"):
        m = med[name]
        print(f"| {RUNNERS[name]} | {m['tokens_per_s']:.1f} | {m['s_per_step']:.3f} | "
              f"{m['tokens_per_s_incl_data']:.1f} | {m['peak_rss_mb']:.0f} | {m['tokens']:.0f} |")
    print(f"\nratio ours / sentence-transformers: {ratio:.2f}x tokens/s "
          f"({ours['tokens_per_s_incl_data'] / theirs['tokens_per_s_incl_data']:.2f}x incl. data)")
    print(json.dumps({"benchmark": "embedding", "steps": args.steps, "warmup": args.warmup,
                      "batch_size": args.batch_size, "max_length": args.max_length, "threads": args.threads,
                      "repeats": args.repeats, "data": described, "ratio_tokens_per_s": ratio,
                      "median": med, "runs": results}))
    if args.profile:
        run_child("twinkle", args, data, profile=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
