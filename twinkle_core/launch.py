"""Start worker processes (torchrun or plain python) in their own session and stream their output.

The orchestrator never shares a process with the model: GPU memory, NCCL/gloo and crashes stay in the
worker tree, and on cancel, timeout or error the whole process group is killed.
"""
from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path
from typing import Callable, Sequence


class WorkerError(RuntimeError):
    """A worker process failed; the message carries the worker's own error."""


def torchrun_command(module: str, args: Sequence[str], nproc_per_node: int = 1,
                     rdzv_endpoint: str | None = None, nnodes: int = 1) -> list[str]:
    """`python -m torch.distributed.run` for one machine (--standalone) or several (c10d rendezvous)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc_per_node}"]
    if rdzv_endpoint:
        cmd += [f"--nnodes={nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint}"]
    else:
        cmd += ["--standalone"]
    return cmd + ["-m", module, *args]


def _pump(stream, lines: queue.Queue) -> None:
    for line in iter(stream.readline, ""):
        lines.put(line.rstrip("\n"))
    lines.put(None)


def _kill_group(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """SIGTERM the process group, then SIGKILL what is left after a grace period."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace_s)
            return
        except subprocess.TimeoutExpired:
            continue


_LAUNCHER_FRAMES = ("torch/distributed/run.py", "torch/distributed/launcher", "ChildFailedError")


def _error_summary(tail: deque) -> str:
    """The worker's own error: its last traceback, not torchrun's report about it; else the last lines."""
    lines = list(tail)
    starts = [i for i, line in enumerate(lines) if "Traceback (most recent call last)" in line]
    blocks = [lines[a:b] for a, b in zip(starts, starts[1:] + [len(lines)])]
    worker = [b for b in blocks if not any(frame in line for line in b for frame in _LAUNCHER_FRAMES)]
    if worker:
        return "\n".join(worker[-1][:60])
    launcher_start = next((a for a, b in zip(starts, blocks) if b not in worker), len(lines))
    return "\n".join(lines[max(0, launcher_start - 20):launcher_start] or lines[-20:])


def _worker_env(extra: dict[str, str] | None) -> dict[str, str]:
    """Workers import the same twinkle_core as this process, whatever their working directory."""
    root = str(Path(__file__).resolve().parents[1])
    path = os.environ.get("PYTHONPATH", "")
    env = {**os.environ, "PYTHONPATH": root + (os.pathsep + path if path else "")}
    return {**env, **(extra or {})}


def run_streaming(cmd: Sequence[str], on_line: Callable[[str], None], timeout_s: float | None = None,
                  env: dict[str, str] | None = None, cwd: str | None = None) -> None:
    """Run `cmd` in a new session, call `on_line` for each output line; raise WorkerError on failure."""
    proc = subprocess.Popen(
        list(cmd), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
        start_new_session=True, env=_worker_env(env), cwd=cwd,
    )
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_pump, args=(proc.stdout, lines), daemon=True).start()
    tail: deque = deque(maxlen=400)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    try:
        while True:
            if deadline is not None and time.monotonic() > deadline:
                raise WorkerError(f"workers ran past the timeout of {timeout_s:.0f} s and were killed:\n"
                                  + "\n".join(list(tail)[-20:]))
            try:
                line = lines.get(timeout=0.5)
            except queue.Empty:
                continue
            if line is None:
                break
            tail.append(line)
            on_line(line)
        code = proc.wait()
    finally:
        if proc.poll() is None:
            _kill_group(proc)
    if code != 0:
        raise WorkerError(f"worker exited with code {code}:\n{_error_summary(tail)}")
