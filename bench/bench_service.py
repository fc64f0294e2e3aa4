"""The training service under load: 4 Tinker SDK clients at once, the same 4 one after another, and local training.

    make bench-service                                   # 4 clients x 3 steps x 4 rows, LoRA r=8 (~5 minutes here)
    python bench/bench_service.py --clients 2 --steps 1  # a quick check that every side runs
    python bench/bench_service.py --repeats 3            # medians over 3 runs of every side
    python bench/bench_service.py --sides service-concurrent --server-args "--fsdp true --nproc-per-node 2"

The model is the default one (SmolLM2-135M-Instruct, flows.params.DEFAULT_MODEL, the GGUF converted once into
a cached HF folder), in `--precision` auto (bf16 where the CPU computes it natively, fp32 elsewhere). The rows
are the bundled self-cognition chats (twinkle_core/datasets/self_cognition/train.jsonl) encoded with the
model's own chat template by the project's tokenizer pipeline (twinkle_core.data.tokenize_dataset, at most
`--max-tokens` tokens a row, assistant-only labels), cut into batches of `--rows` in our seeded order (seed 42):
batch 0 is a warm-up, then client c's step s trains batch 1 + c x steps + s, so every side trains the very same
rows. Each client is its own tenant (API key tml-bench-c) with a LoRA adapter of rank `--rank` (Tinker's fixed
alpha 32, every attention and MLP linear layer, seed c), and does `--steps` times
`forward_backward(its batch, "cross_entropy")` (target = the next token, weight 1 on assistant tokens, 0
elsewhere) then `optim_step(AdamParams(learning_rate=--lr))` (Tinker's defaults: betas 0.9/0.95, eps 1e-12,
no weight decay, no clipping), waiting for each result before the next call.

Sides, each in its own process (this script run again with --side):
- `service-concurrent`: a server (`python -m flows.service --model-id M --port P --state-dir TMP`, see below),
  one SDK `tinker.ServiceClient` per tenant, the tenants trained from `--clients` threads of one process
  released together (the SDK runs every client's HTTP calls on one background asyncio loop, so threads do not
  serialise on it: the requests overlap, which the pass count shows);
- `service-sequential`: a fresh server, the same tenants trained one after another from one thread;
- `local`: the same training in-process with `TransformersModel` (twinkle_core.models), no HTTP: per tenant a
  fresh model (its loading not timed), the same LoRA (rank, alpha 32, the family's target layers, the same
  seed), AdamW with the same settings, `forward_backward` + `clip_grad_and_step(None)` on the same rows.

Measured: the wall time of the training calls only (server start, model loading, client and adapter creation
and one warm-up step on a throw-away tenant come first and are not timed). rows/s = trained rows / wall time;
tokens/s = trained (assistant) tokens / wall time. HTTP overhead per request = (service-sequential wall -
local wall) / requests (forward_backward + optim_step calls), as asked; because the server's engine is not the
local code path (below), the table also gives (service wall - the engine's own busy time) / requests, the time
a request spends outside the model: SDK, HTTP, polling and queueing. Passes: the forward_backward passes the
server ran against the forward_backward requests it got (fewer passes than requests = requests shared a
mixed-tenant pass). Peak RSS (VmHWM): the server's worker process (the one holding the model) and the HTTP
process (summed over the workers, and the largest one: what one device must hold); the local process's own.

To count passes and the engine's busy time the server runs as `python bench/bench_service.py --serve ARGS`:
the very `python -m flows.service ARGS` (runpy, same module, same arguments) with one wrapper around
`EngineRunner._execute` that prints each executed job batch (kind, jobs, rows, seconds) to stdout; the HTTP
API has no such counter. Every process (server, worker, local) runs with the allocator settings our launcher
gives CPU workers (twinkle_core.launch.cpu_allocator_env) and torch's default thread count.

Known differences between the service's engine and local training, which the first overhead figure includes:
the engine pads a mixed-tenant batch and computes the full-vocabulary log-softmax of every position (Tinker's
API returns per-token logprobs), routes rows through MultiLoraTransformersModel's LoRA slots, and steps with
torch's default AdamW; local training is padding-free, projects the output layer at trained positions only,
and uses the fused AdamW; the service sums the loss over tokens (Tinker), local training averages it.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/: bench_sft

from bench_sft import BUNDLED, DEFAULT_MODEL, RESULT, ROOT, SEED, ordered_rows, peak_rss_mb  # noqa: E402

SIDES = ("service-concurrent", "service-sequential", "local")
JOB = "BENCH_JOB "  # one line per job batch the server's engine ran (the --serve wrapper)
LORA_ALPHA = 32  # the service's fixed alpha (twinkle_service/engine.py)


# ----- the server ----------------------------------------------------------------------------------------
def serve(argv: list[str]) -> None:
    """`python -m flows.service ARGV`, with every executed job batch printed (the pass counter)."""
    import runpy

    from twinkle_service import runner

    original = runner.EngineRunner._execute

    def counted(self, jobs):
        rows = sum(len(job.args.data) for job in jobs) if jobs[0].kind == runner.FORWARD_BACKWARD else 0
        start = time.perf_counter()
        try:
            return original(self, jobs)
        finally:
            print(JOB + json.dumps({"kind": jobs[0].kind, "jobs": len(jobs), "rows": rows,
                                    "s": time.perf_counter() - start}), flush=True)

    runner.EngineRunner._execute = counted
    sys.argv = ["flows.service", *argv]
    runpy.run_module("flows.service", run_name="__main__", alter_sys=True)


def vm_hwm_mb(pid: int) -> float:
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


class Server:
    """The service in a subprocess on a free port; its output lines are collected by a thread."""

    def __init__(self, model_id: str, precision: str, rank: int, max_tenants: int, state_dir: str,
                 extra: list[str] = ()):
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        sock.close()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, __file__, "--serve", "--model-id", model_id, "--port", str(self.port),
               "--state-dir", state_dir, "--precision", precision, "--max-lora-rank", str(rank),
               "--max-tenants", str(max_tenants), *extra]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                                     cwd=ROOT, env=os.environ.copy())
        self.lines: list[str] = []
        self.jobs: list[dict] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._pump, daemon=True).start()
        self._wait_healthy(600)

    def _pump(self) -> None:
        for line in iter(self.proc.stdout.readline, ""):
            line = line.rstrip("\n")
            with self._lock:
                if line.startswith(JOB):
                    self.jobs.append(json.loads(line[len(JOB):]))
                else:
                    self.lines.append(line)

    def _wait_healthy(self, timeout_s: float) -> None:
        import urllib.request

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                time.sleep(0.5)
                raise SystemExit(f"the server exited ({self.proc.returncode}):\n" + "\n".join(self.lines[-40:]))
            try:
                with urllib.request.urlopen(f"{self.url}/api/v1/healthz", timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:
                time.sleep(0.2)
        raise SystemExit(f"the server did not answer within {timeout_s:.0f} s:\n" + "\n".join(self.lines[-40:]))

    def jobs_since(self, mark: int, expected: int, timeout_s: float = 30.0) -> list[dict]:
        """The training job batches (forward_backward, optim_step) run after `mark`, once `expected` jobs are in
        (each line is printed after its results went out)."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                batch = [j for j in self.jobs[mark:] if j["kind"] in ("forward_backward", "optim_step")]
            if sum(j["jobs"] for j in batch) >= expected or time.monotonic() > deadline:
                return batch
            time.sleep(0.05)

    def peak_rss(self) -> dict:
        import psutil

        workers = [p for p in psutil.Process(self.proc.pid).children(recursive=True)  # not torchrun's agent
                   if "twinkle_service.worker" in " ".join(p.cmdline()) and "torch.distributed.run" not in p.cmdline()]
        peaks = [vm_hwm_mb(p.pid) for p in workers]
        return {"worker_peak_rss_mb": sum(peaks) if peaks else float("nan"),
                "largest_worker_peak_rss_mb": max(peaks) if peaks else float("nan"),
                "workers": len(workers), "http_peak_rss_mb": vm_hwm_mb(self.proc.pid)}

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)  # uvicorn's graceful shutdown stops the runner and the worker
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


# ----- the rows ----------------------------------------------------------------------------------------
def datum(row: dict):
    """A row as Tinker's cross_entropy datum: next-token targets, weight 1 where the row trains (assistant)."""
    import numpy as np
    from tinker import types

    ids, labels = row["input_ids"], row["labels"]
    weights = np.array([1.0 if label != -100 else 0.0 for label in labels[1:]], dtype=np.float32)
    return types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                       loss_fn_inputs={"target_tokens": np.array(ids[1:], dtype=np.int64), "weights": weights})


def trained_tokens(rows: list[dict]) -> int:
    return sum(sum(1 for label in r["labels"][1:] if label != -100) for r in rows)


def client_batches(batches: list[list[dict]], clients: int, steps: int) -> list[list[list[dict]]]:
    return [[batches[1 + c * steps + s] for s in range(steps)] for c in range(clients)]


# ----- the sides -----------------------------------------------------------------------------------------
def run_service(args, batches: list[list[dict]], concurrent: bool) -> dict:
    os.environ["TINKER_TELEMETRY"] = "0"
    import tinker
    from tinker import types

    own = client_batches(batches, args.clients, args.steps)
    with tempfile.TemporaryDirectory(prefix="bench-service-state-") as state_dir:
        server = Server(args.model_id, args.precision, args.rank, args.clients + 1, state_dir,
                        args.server_args.split())
        try:
            # warm-up: the model loads, a throw-away tenant trains one step (first-call costs), its session ends
            warm = tinker.ServiceClient(base_url=server.url, api_key="tml-bench-warmup")
            name = args.model_id  # the server's model name (no --model-name)
            training = warm.create_lora_training_client(base_model=name, rank=args.rank, seed=999).result()
            training.forward_backward([datum(r) for r in batches[0]], "cross_entropy").result()
            training.optim_step(types.AdamParams(learning_rate=args.lr)).result()
            warm.close("success").result()
            clients = [tinker.ServiceClient(base_url=server.url, api_key=f"tml-bench-{c}") for c in range(args.clients)]
            trainers = [client.create_lora_training_client(base_model=name, rank=args.rank, seed=c).result()
                        for c, client in enumerate(clients)]
            data = [[[datum(r) for r in rows] for rows in mine] for mine in own]
            latency: dict[str, list[float]] = {"forward_backward": [], "optim_step": []}
            losses: list[list[float]] = [[] for _ in trainers]
            errors: list[str] = []
            go = threading.Event()

            def train(c: int) -> None:
                go.wait()
                try:
                    for step in data[c]:
                        t0 = time.perf_counter()
                        result = trainers[c].forward_backward(step, "cross_entropy").result()
                        t1 = time.perf_counter()
                        trainers[c].optim_step(types.AdamParams(learning_rate=args.lr)).result()
                        t2 = time.perf_counter()
                        latency["forward_backward"].append(t1 - t0)
                        latency["optim_step"].append(t2 - t1)
                        losses[c].append(result.metrics["loss:sum"])
                except Exception as exc:  # reported in the result, not lost in a thread
                    errors.append(f"client {c}: {type(exc).__name__}: {exc}")

            mark = len(server.jobs)
            if concurrent:
                threads = [threading.Thread(target=train, args=(c,)) for c in range(args.clients)]
                for thread in threads:
                    thread.start()
                start = time.perf_counter()
                go.set()
                for thread in threads:
                    thread.join()
            else:
                go.set()
                start = time.perf_counter()
                for c in range(args.clients):
                    train(c)
            wall = time.perf_counter() - start
            requests = 2 * args.clients * args.steps
            jobs = server.jobs_since(mark, requests)
            rss = server.peak_rss()
            for client in clients:
                client.close("success").result()
        finally:
            server.stop()
    fb = [j for j in jobs if j["kind"] == "forward_backward"]
    rows = sum(len(b) for mine in own for b in mine)
    return {"seconds": wall, "rows": rows, "trained_tokens": sum(trained_tokens(b) for mine in own for b in mine),
            "rows_per_s": rows / wall,
            "tokens_per_s": sum(trained_tokens(b) for mine in own for b in mine) / wall,
            "requests": requests, "fb_requests": sum(j["jobs"] for j in fb), "fb_passes": len(fb),
            "rows_per_pass": [j["rows"] for j in fb], "seconds_per_pass": [round(j["s"], 2) for j in fb],
            "engine_busy_s": sum(j["s"] for j in jobs), "fb_engine_s": sum(j["s"] for j in fb),
            "median_fb_latency_s": statistics.median(latency["forward_backward"] or [float("nan")]),
            "median_optim_latency_s": statistics.median(latency["optim_step"] or [float("nan")]),
            "first_losses": [l[0] for l in losses if l], "last_losses": [l[-1] for l in losses if l],
            "errors": errors, **rss}


def run_local(args, batches: list[list[dict]]) -> dict:
    import torch
    from peft import LoraConfig

    from twinkle_core.data import collate, collate_padding_free
    from twinkle_core.models import TransformersModel

    own = client_batches(batches, args.clients, args.steps)

    def tenant(seed: int, mine: list[list[dict]]) -> tuple[float, list[float], bool]:
        model = TransformersModel(args.model_id, mixed_precision=args.precision)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model.add_adapter_to_model("default", LoraConfig(r=args.rank, lora_alpha=LORA_ALPHA, lora_dropout=0.0))
        model.set_optimizer("AdamW", lr=args.lr, betas=(0.9, 0.95), eps=1e-12, weight_decay=0.0)
        pad = model.tokenizer.pad_token_id
        losses, seconds = [], 0.0
        for rows in mine:
            start = time.perf_counter()
            batch = collate_padding_free(rows) if model.padding_free else collate(rows, pad_token_id=pad)
            losses.append(float(model.forward_backward(batch)))
            model.clip_grad_and_step(max_grad_norm=None)
            seconds += time.perf_counter() - start
        model.close()
        return seconds, losses, model.padding_free

    tenant(999, [batches[0]])  # warm-up: first-call costs, as the service's throw-away tenant
    results = [tenant(c, mine) for c, mine in enumerate(own)]
    wall = sum(seconds for seconds, _, _ in results)
    rows = sum(len(b) for mine in own for b in mine)
    tokens = sum(trained_tokens(b) for mine in own for b in mine)
    return {"seconds": wall, "rows": rows, "trained_tokens": tokens, "rows_per_s": rows / wall,
            "tokens_per_s": tokens / wall, "requests": 2 * args.clients * args.steps,
            "first_losses": [l[0] for _, l, _ in results], "last_losses": [l[-1] for _, l, _ in results],
            "padding_free": results[0][2], "local_peak_rss_mb": peak_rss_mb()}


def side(args) -> None:
    import torch

    batches = json.loads(Path(args.rows_file).read_text())
    if args.side == "local":
        result = run_local(args, batches)
    else:
        result = run_service(args, batches, concurrent=args.side == "service-concurrent")
    result.update(side=args.side, threads=torch.get_num_threads(), client_peak_rss_mb=peak_rss_mb())
    print(RESULT + json.dumps(result), flush=True)


def run_child(args, which: str, rows_file: Path) -> dict:
    from twinkle_core.launch import cpu_allocator_env

    cmd = [sys.executable, __file__, "--side", which, "--rows-file", str(rows_file), "--model-id", args.model_id,
           "--precision", args.precision, "--clients", str(args.clients), "--steps", str(args.steps),
           "--rows", str(args.rows), "--rank", str(args.rank), "--lr", str(args.lr),
           f"--server-args={args.server_args}"]
    # every process (server, its worker, local) with the allocator settings our launcher gives CPU workers
    env = {**os.environ, **cpu_allocator_env(), "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false",
           "TINKER_TELEMETRY": "0"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-4000:]}")
    line = next(l for l in reversed(proc.stdout.splitlines()) if l.startswith(RESULT))
    return json.loads(line[len(RESULT):])


def med(runs: list[dict], key: str, digits: int = 2) -> str:
    values = [r[key] for r in runs]
    text = f"{statistics.median(values):.{digits}f}"
    return text if len(values) == 1 else f"{text} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--serve":
        serve(sys.argv[2:])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-id", default=DEFAULT_MODEL)
    parser.add_argument("--precision", default="auto", choices=["auto", "bf16", "no"])
    parser.add_argument("--clients", type=int, default=4, help="tenants, each its own API key and SDK client")
    parser.add_argument("--steps", type=int, default=3, help="forward_backward + optim_step per client")
    parser.add_argument("--rows", type=int, default=4, help="rows per forward_backward")
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank")
    parser.add_argument("--max-tokens", type=int, default=128, help="longest row, in tokens")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--sides", default=",".join(SIDES), help=f"of {','.join(SIDES)}")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--server-args", default="", help="more options of the server, e.g. '--fsdp true "
                        "--nproc-per-node 2' or '--backend megatron --nproc-per-node 2 --tp-size 2'")
    parser.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)
    parser.add_argument("--rows-file", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:
        side(args)
        return 0
    began = time.perf_counter()
    sides = args.sides.split(",")
    from twinkle_core.hub import resolve_model

    model_dir = str(resolve_model(args.model_id).path)
    batches = ordered_rows(BUNDLED, model_dir, args.rows, 1 + args.clients * args.steps, args.max_tokens)
    if len(batches) < 1 + args.clients * args.steps:
        parser.error(f"the bundled set holds {len(batches)} batches of {args.rows}; "
                     f"{1 + args.clients * args.steps} are needed (1 warm-up + clients x steps)")
    work = Path(tempfile.mkdtemp(prefix="bench-service-"))
    rows_file = work / "rows.json"
    rows_file.write_text(json.dumps(batches))
    measured = [r for b in batches[1:] for r in b]
    lengths = [len(r["input_ids"]) for r in measured]
    settings = {"model_id": args.model_id, "precision": args.precision, "clients": args.clients,
                "steps": args.steps, "rows": args.rows, "rank": args.rank, "lora_alpha": LORA_ALPHA,
                "max_tokens": args.max_tokens, "lr": args.lr, "repeats": args.repeats, "seed": SEED,
                "data": str(BUNDLED.relative_to(ROOT)), "row_tokens_min_mean_max":
                [min(lengths), round(sum(lengths) / len(lengths), 1), max(lengths)],
                "trained_tokens": trained_tokens(measured), "cpus": os.cpu_count()}
    print(f"settings: {args.clients} clients x {args.steps} steps x {args.rows} rows ({len(measured)} trained rows, "
          f"{min(lengths)}-{max(lengths)} tokens, mean {settings['row_tokens_min_mean_max'][1]}; "
          f"{settings['trained_tokens']} trained tokens), LoRA r={args.rank} alpha {LORA_ALPHA}, AdamW lr {args.lr}, "
          f"precision {args.precision}, {args.repeats} repeat(s), {os.cpu_count()} CPUs", flush=True)
    runs: dict[str, list[dict]] = {s: [] for s in sides}
    for repeat in range(args.repeats):
        for which in sides if repeat % 2 == 0 else sides[::-1]:
            r = run_child(args, which, rows_file)
            runs[which].append(r)
            extra = "" if which == "local" else (
                f", {r['fb_passes']} passes for {r['fb_requests']} forward_backward requests "
                f"(rows per pass {r['rows_per_pass']}, seconds {r['seconds_per_pass']}), "
                f"engine busy {r['engine_busy_s']:.2f} s, worker peak RSS "
                f"{r['worker_peak_rss_mb']:.0f} MB (largest worker {r['largest_worker_peak_rss_mb']:.0f} MB)"
                + (f", ERRORS {r['errors']}" if r["errors"] else ""))
            print(f"  repeat {repeat + 1} {which:18s} {r['seconds']:7.2f} s  {r['rows_per_s']:.3f} rows/s  "
                  f"{r['tokens_per_s']:.1f} tokens/s{extra}", flush=True)
    summary: dict = {}
    if "service-sequential" in runs and "local" in runs:
        seq = statistics.median(r["seconds"] for r in runs["service-sequential"])
        local = statistics.median(r["seconds"] for r in runs["local"])
        requests = runs["local"][0]["requests"]
        summary["http_overhead_s_per_request"] = (seq - local) / requests
    for which in ("service-concurrent", "service-sequential"):
        if which in runs:
            summary[f"{which}_outside_engine_s_per_request"] = statistics.median(
                (r["seconds"] - r["engine_busy_s"]) / r["requests"] for r in runs[which])
    label = {"service-concurrent": f"service, {args.clients} SDK clients at once",
             "service-sequential": f"service, {args.clients} SDK clients one after another",
             "local": f"local TransformersModel, {args.clients} adapters one after another"}
    print(f"\nTraining service (Tinker SDK {_sdk_version()}) vs local: {args.clients} tenants x {args.steps} steps "
          f"(forward_backward + optim_step) x {args.rows} rows of <= {args.max_tokens} tokens, LoRA r={args.rank}, "
          f"{args.precision} precision, {os.cpu_count()} CPUs" +
          (f", median of {args.repeats}" if args.repeats > 1 else ""))
    print("| run | wall s | rows/s | tokens/s | fb passes / fb requests | fb latency s (median) "
          "| optim latency s (median) | engine busy s | outside engine s/request | peak RSS MB |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for which, rs in runs.items():
        if which == "local":
            print(f"| {label[which]} | {med(rs, 'seconds')} | {med(rs, 'rows_per_s', 3)} | "
                  f"{med(rs, 'tokens_per_s', 1)} | - | - | - | - | - | {med(rs, 'local_peak_rss_mb', 0)} (process) |")
            continue
        passes = (f"{statistics.median(r['fb_passes'] for r in rs):g} / "
                  f"{statistics.median(r['fb_requests'] for r in rs):g}")
        outside = statistics.median((r["seconds"] - r["engine_busy_s"]) / r["requests"] for r in rs)
        print(f"| {label[which]} | {med(rs, 'seconds')} | {med(rs, 'rows_per_s', 3)} | {med(rs, 'tokens_per_s', 1)} "
              f"| {passes} | {med(rs, 'median_fb_latency_s')} | {med(rs, 'median_optim_latency_s')} "
              f"| {med(rs, 'engine_busy_s')} | {outside:.3f} | {med(rs, 'worker_peak_rss_mb', 0)} (workers; largest "
              f"{med(rs, 'largest_worker_peak_rss_mb', 0)}), "
              f"{med(rs, 'http_peak_rss_mb', 0)} (HTTP) |")
    if "http_overhead_s_per_request" in summary:
        print(f"\nHTTP overhead per request ((service one after another - local) / {runs['local'][0]['requests']} "
              f"requests): {summary['http_overhead_s_per_request']:.3f} s")
    if "service-concurrent" in runs and "service-sequential" in runs:
        summary["concurrent_speedup"] = (statistics.median(r["seconds"] for r in runs["service-sequential"]) /
                                         statistics.median(r["seconds"] for r in runs["service-concurrent"]))
        print(f"{args.clients} clients at once vs one after another: {summary['concurrent_speedup']:.2f}x")
    summary["bench_wall_s"] = time.perf_counter() - began
    print(f"benchmark wall time: {summary['bench_wall_s']:.0f} s", flush=True)
    print(json.dumps({"settings": settings, "summary": summary, "runs": runs}, default=str))
    return 0


def _sdk_version() -> str:
    try:
        import tinker

        return tinker.__version__
    except Exception:
        return "?"


if __name__ == "__main__":
    sys.exit(main())
