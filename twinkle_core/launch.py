"""Start worker processes (torchrun or plain python) in their own session and stream their output.

The orchestrator never shares a process with the model: GPU memory, NCCL/gloo and crashes stay in the
worker tree, and on cancel, timeout or error the whole process tree is killed (torchrun's workers each
lead a session of their own, so the tree is found through /proc, not by process group); on Linux the
worker tree also gets SIGTERM when the process that started it dies without cleaning up.
"""
from __future__ import annotations

import json
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

from twinkle_core.config.fields import check_launch
from twinkle_core.entry import USER_ERROR_MARK
from twinkle_core.errors import UserError


class WorkerError(RuntimeError):
    """A worker process failed; the message carries the worker's own error."""


class WorkerUserError(UserError):
    """A worker ended on the user's error (its own UserError, reported in one line): the same message here."""


def torchrun_command(module: str, args: Sequence[str], nproc_per_node: int = 1, rdzv_endpoint: str | None = None,
                     nnodes: int = 1, node_rank: int = 0, rdzv_id: str = "twinkle", max_restarts: int = 0) -> list[str]:
    """`python -m torch.distributed.run` for one machine (--standalone) or several (c10d rendezvous).

    With an endpoint, every machine runs this same command except for `node_rank`; the agents meet at the
    endpoint under `rdzv_id` and start nnodes × nproc_per_node workers. Nothing device-specific is set:
    the workers pick gloo on CPU and nccl on GPU themselves.
    """
    check_launch(nnodes, node_rank, rdzv_endpoint)
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc_per_node}"]
    if rdzv_endpoint:
        cmd += [f"--nnodes={nnodes}", f"--node-rank={node_rank}", "--rdzv-backend=c10d",
                f"--rdzv-endpoint={rdzv_endpoint}", f"--rdzv-id={rdzv_id}"]
    else:
        cmd += ["--standalone"]
    return cmd + [f"--max-restarts={max_restarts}", "-m", module, *args]


def torchrun_command_for(parallel, module: str, args: Sequence[str]) -> list[str]:
    """The command that starts this machine's share of a run laid out by `parallel`: torchrun, or for one
    process on one machine the worker itself (the agent would only add a process start, ~2 s, and a
    rendezvous; the worker then joins a one-process group of its own)."""
    if parallel.nproc_per_node == 1 and parallel.nnodes == 1 and not parallel.rdzv_endpoint \
            and not parallel.max_restarts:
        return [sys.executable, "-m", module, *args]
    return torchrun_command(module, args, parallel.nproc_per_node, parallel.rdzv_endpoint, parallel.nnodes,
                            parallel.node_rank, parallel.rdzv_id, parallel.max_restarts)


def cpu_threads_env(nproc_per_node: int) -> dict[str, str]:
    """OMP_NUM_THREADS for CPU workers: this machine's cores shared out among them.

    torchrun gives each worker 1 thread when there are several (right for GPU workers); CPU workers would
    then leave most cores idle. A value the user set is kept, and GPU machines get nothing.
    """
    import torch

    if "OMP_NUM_THREADS" in os.environ or torch.cuda.is_available():
        return {}
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return {"OMP_NUM_THREADS": str(max(1, cores // nproc_per_node))}


# glibc's allocator hands freed memory back to the kernel and maps big blocks afresh, so a CPU training step pays
# page faults for every large activation again (on 2 cores, a third of a long-sequence step's time was system
# time). Fixing the mmap threshold at its maximum (32 MiB) and never trimming keeps freed blocks for reuse.
CPU_ALLOCATOR_ENV = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(16 << 30),
                     "MALLOC_TOP_PAD_": str(512 << 20)}


def cpu_allocator_env() -> dict[str, str]:
    """glibc malloc settings for CPU training workers (CPU_ALLOCATOR_ENV); a value the user set is kept, and GPU
    machines get nothing (their activations live in torch's own caching allocator)."""
    import torch

    if torch.cuda.is_available() or not sys.platform.startswith("linux"):
        return {}
    return {name: value for name, value in CPU_ALLOCATOR_ENV.items() if name not in os.environ}


def _pump(stream, lines: queue.Queue) -> None:
    for line in iter(stream.readline, ""):
        lines.put(line.rstrip("\n"))
    lines.put(None)


def _descendants(pid: int) -> list[int]:
    """Every live process below `pid`, from /proc (empty where there is no /proc)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        below = children.get(todo.pop(), [])
        found += below
        todo += below
    return found


def _is_running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def _kill_tree(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """SIGTERM the worker tree, then SIGKILL what is left after a grace period.

    The tree, not only our process group: torchrun starts each worker in a session of its own, so a
    SIGKILL that reaches only the agent would leave the workers running.
    """
    tree = [proc.pid, *_descendants(proc.pid)]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in tree:
            for send in (os.killpg, os.kill):  # its group where it leads one (workers do), and itself
                try:
                    send(pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and (proc.poll() is None or any(map(_is_running, tree[1:]))):
            time.sleep(0.1)
        if proc.poll() is not None and not any(map(_is_running, tree[1:])):
            return


_LAUNCHER_FRAMES = ("torch/distributed/run.py", "torch/distributed/launcher", "ChildFailedError")
# A rank whose peer died fails in its collective with one of these: the peer's own error is the cause.
_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "remote process exited", "Broken pipe")


def _error_summary(tail: deque) -> str:
    """The worker's own error: its last traceback, not torchrun's report about it and not that of a rank
    which failed only because a peer died; else the last lines. Ranks print at once, so a traceback is the
    lines carrying its rank's prefix ("[rank1]: ")."""
    lines, marker = list(tail), "Traceback (most recent call last)"
    starts = [i for i, line in enumerate(lines) if marker in line]
    blocks = []
    for start in starts:
        prefix, block = lines[start].split(marker)[0], [lines[start]]
        for line in lines[start + 1:]:
            if line.startswith(prefix):
                if marker in line:
                    break
                block.append(line)
        blocks.append(block)
    worker = [b for b in blocks if not any(frame in line for line in b for frame in _LAUNCHER_FRAMES)]
    causes = [b for b in worker if not any(mark in line for line in b for mark in _PEER_GONE)]
    if worker:
        return "\n".join((causes or worker)[-1][:60])
    launcher_start = next((a for a, b in zip(starts, blocks) if b not in worker), len(lines))
    return "\n".join(lines[max(0, launcher_start - 20):launcher_start] or lines[-20:])


def _die_with_parent() -> None:
    """Linux: SIGTERM this child if the process that started it dies (even by SIGKILL), so an orchestrator
    killed without notice leaves no training behind; torchrun's agent passes the SIGTERM to its workers."""
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


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
        preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
    )
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_pump, args=(proc.stdout, lines), daemon=True).start()
    tail: deque = deque(maxlen=400)
    user_errors: list[str] = []
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
            if USER_ERROR_MARK in line:  # a worker's UserError: kept for the error below, not streamed
                user_errors.append(json.loads(line.split(USER_ERROR_MARK, 1)[1])["message"])
                continue
            tail.append(line)
            on_line(line)
        code = proc.wait()
    finally:
        if proc.poll() is None:
            _kill_tree(proc)
    if code != 0 and user_errors:
        raise WorkerUserError(user_errors[0])
    if code != 0:
        raise WorkerError(f"worker exited with code {code}:\n{_error_summary(tail)}")
