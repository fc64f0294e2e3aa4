"""A 2-process sft run on a large generated chat set: what each training worker holds, against a small set.

    python bench/bench_sft_scale.py                          # 2,000 and 100,000 rows, 3 steps, 2 processes
    python bench/bench_sft_scale.py --rows 1000,20000 --steps 2

For each size, the script generates the chat set (bench_data.py's generator: a user turn of 10-80 words and a
reply of 20-400 words), then runs the real flow as a user would,

    python -m flows.sft --dataset SET.jsonl --max-steps 3 --nproc-per-node 2 --max-length 512

(tokenise with the default worker processes, train with torchrun, evaluate, register), in a fresh cache and
MLflow store. A thread samples every 0.1 s the RSS of each training worker (the processes running
twinkle_core.train) and keeps each one's peak. Both sizes train the same number of steps on batches of 8 rows of
the same length distribution, so the difference between their workers' peaks is what the larger data set costs
a worker (its rows are memory-mapped and read per batch, so it should be close to nothing).
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from bench_data import write_chat  # noqa: E402  (the same generated rows as make bench-data)


class WorkerPeaks:
    """Each training worker's peak RSS (MB), sampled in a thread from the flow process's descendants."""

    def __init__(self, pid: int, interval: float = 0.1):
        import psutil

        self.root, self.interval, self.peaks, self._stop = psutil.Process(pid), interval, {}, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import psutil

        while not self._stop.is_set():
            try:
                children = self.root.children(recursive=True)
            except psutil.Error:
                return
            for proc in children:
                try:
                    if "twinkle_core.train" in " ".join(proc.cmdline()) and "torch.distributed.run" not in \
                            " ".join(proc.cmdline()):
                        self.peaks[proc.pid] = max(self.peaks.get(proc.pid, 0), proc.memory_info().rss / 2**20)
                except psutil.Error:
                    pass
            time.sleep(self.interval)

    def stop(self) -> list[float]:
        self._stop.set()
        self._thread.join()
        return sorted(self.peaks.values(), reverse=True)


def run_flow(data: Path, work: Path, steps: int, nproc: int, max_length: int) -> dict:
    env = {**os.environ, "TWINKLE_CACHE": str(work / "cache"), "MLFLOW_TRACKING_URI": f"sqlite:///{work}/mlflow.db",
           "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "flows.sft", "--dataset", str(data), "--max-steps", str(steps), "--nproc-per-node",
           str(nproc), "--max-length", str(max_length), "--output-dir", str(work / "runs")]
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    peaks = WorkerPeaks(proc.pid)
    log = proc.stdout.read()
    proc.wait()
    workers = peaks.stop()
    if proc.returncode:
        sys.exit(f"the flow failed ({proc.returncode}):\n{log[-4000:]}")
    losses = re.findall(r"final loss ([0-9.]+)", log)
    tokenised = re.search(r"dataset: .*?\(([0-9,]+) rows, ([0-9,]+) trained tokens", log)
    return {"seconds": time.perf_counter() - started, "workers_mb": workers[:nproc], "final_loss": losses[-1:],
            "rows": tokenised.group(1) if tokenised else "?"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="2000,100000", help="comma-separated chat set sizes")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--nproc-per-node", type=int, default=2)
    parser.add_argument("--max-length", type=int, default=512)
    args = parser.parse_args()
    print(f"| chat rows | flow s | worker peak RSS MB (each rank) | final loss |\n|---|---|---|---|")
    for rows in [int(n) for n in args.rows.split(",")]:
        with tempfile.TemporaryDirectory(prefix="twinkle-scale-") as tmp:
            work = Path(tmp)
            data = work / f"chat{rows}.jsonl"
            write_chat(data, rows)
            result = run_flow(data, work, args.steps, args.nproc_per_node, args.max_length)
            print(f"| {rows:,} ({data.stat().st_size / 2**20:.0f} MB) | {result['seconds']:.0f} | "
                  f"{', '.join(f'{mb:,.0f}' for mb in result['workers_mb'])} | {' '.join(result['final_loss'])} |",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
