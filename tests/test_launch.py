"""The worker launcher: errors carry the worker's own message; timeouts kill the whole process group;
several machines meet at a c10d rendezvous."""
import socket
import sys
import threading
import time

import pytest

from twinkle_core.launch import (CPU_ALLOCATOR_ENV, WorkerError, cpu_allocator_env, cpu_threads_env, run_streaming,
                                 torchrun_command, torchrun_command_for)
from twinkle_core.parallel import ParallelConfig


def test_output_is_streamed_line_by_line():
    seen = []
    run_streaming([sys.executable, "-c", "print('one'); print('two')"], seen.append)
    assert seen == ["one", "two"]


def test_a_failing_worker_raises_with_its_traceback():
    code = "def train():\n    raise ValueError('learning rate is nan')\ntrain()"
    with pytest.raises(WorkerError) as err:
        run_streaming([sys.executable, "-c", code], lambda line: None)
    assert "exited with code 1" in str(err.value)
    assert "ValueError: learning rate is nan" in str(err.value)


def test_timeout_kills_the_whole_process_group():
    code = ("import subprocess, time\n"
            "child = subprocess.Popen(['sleep', '60'])\n"
            "print(child.pid, flush=True)\n"
            "time.sleep(60)\n")
    pids = []
    started = time.monotonic()
    with pytest.raises(WorkerError, match="timeout"):
        run_streaming([sys.executable, "-c", code], pids.append, timeout_s=3)
    assert time.monotonic() - started < 30
    grandchild = int(pids[0])
    time.sleep(0.5)
    assert not _is_alive(grandchild)  # the grandchild died with its group


def _is_alive(pid: int) -> bool:
    """Running (a zombie waiting for a reaper that is not its parent counts as dead)."""
    try:
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")


def test_torchrun_command_shapes():
    single = torchrun_command("twinkle_core.train", ["cfg.json"], nproc_per_node=2)
    assert single[1:4] == ["-m", "torch.distributed.run", "--nproc-per-node=2"]
    assert "--standalone" in single and single[-3:] == ["-m", "twinkle_core.train", "cfg.json"]
    assert not any(arg.startswith(("--nnodes", "--rdzv")) for arg in single)


def test_one_process_on_one_machine_runs_the_worker_without_an_agent():
    cmd = torchrun_command_for(ParallelConfig(), "twinkle_core.train", ["cfg.json"])
    assert cmd == [sys.executable, "-m", "twinkle_core.train", "cfg.json"]
    restarts = torchrun_command_for(ParallelConfig(max_restarts=2), "twinkle_core.train", ["cfg.json"])
    assert restarts[1:3] == ["-m", "torch.distributed.run"]  # restarts need the agent


def test_multi_node_command_names_every_rendezvous_setting():
    parallel = ParallelConfig(nproc_per_node=8, nnodes=2, node_rank=1, rdzv_endpoint="head:29500",
                              rdzv_id="run-7", max_restarts=3)
    cmd = torchrun_command_for(parallel, "twinkle_core.train", ["cfg.json"])
    assert cmd[3:-3] == ["--nproc-per-node=8", "--nnodes=2", "--node-rank=1", "--rdzv-backend=c10d",
                         "--rdzv-endpoint=head:29500", "--rdzv-id=run-7", "--max-restarts=3"]
    assert cmd[-3:] == ["-m", "twinkle_core.train", "cfg.json"] and "--standalone" not in cmd
    assert parallel.world_size() == 16


@pytest.mark.parametrize("settings,words", [
    (dict(nnodes=2), ["nnodes=2", "rdzv_endpoint", "HOST:PORT"]),
    (dict(nnodes=2, node_rank=2, rdzv_endpoint="head:29500"), ["node_rank=2", "nnodes=2", "from 0 to 1"]),
    (dict(nnodes=2, rdzv_endpoint="head"), ["rdzv_endpoint='head'", "HOST:PORT"]),
    (dict(nnodes=2, rdzv_endpoint="head:99999"), ["rdzv_endpoint='head:99999'", "HOST:PORT"]),
    (dict(max_restarts=-1), ["max_restarts", "greater than or equal to 0"]),
])
def test_wrong_multi_node_settings_fail_before_launch(settings, words):
    with pytest.raises(ValueError) as err:
        ParallelConfig(**settings)
    for word in words:
        assert word in str(err.value)


def test_the_command_itself_rejects_a_second_node_without_a_rendezvous():
    with pytest.raises(ValueError, match="rdzv_endpoint"):
        torchrun_command("twinkle_core.train", [], nproc_per_node=1, nnodes=2)


def test_cpu_workers_share_the_cores_unless_told(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(16)))
    assert cpu_threads_env(nproc_per_node=2) == {"OMP_NUM_THREADS": "8"}
    assert cpu_threads_env(nproc_per_node=32) == {"OMP_NUM_THREADS": "1"}
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert cpu_threads_env(nproc_per_node=2) == {}


def test_cpu_workers_keep_freed_memory_for_reuse_unless_told(monkeypatch):
    """The allocator settings reach a real worker process (glibc reads them at start), and a user's value wins."""
    for name in CPU_ALLOCATOR_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert cpu_allocator_env() == CPU_ALLOCATOR_ENV
    monkeypatch.setenv("MALLOC_TOP_PAD_", "0")
    env = cpu_allocator_env()
    assert "MALLOC_TOP_PAD_" not in env and env["MALLOC_MMAP_THRESHOLD_"] == str(32 << 20)
    seen = []
    run_streaming([sys.executable, "-c", "import os; print(os.environ['MALLOC_TRIM_THRESHOLD_'])"], seen.append,
                  env=env)
    assert seen == [str(16 << 30)]


ALLREDUCE_WORKER = """
import os
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
value = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(value)
print(f"rank {dist.get_rank()} of {dist.get_world_size()}: sum {value.item():.0f}", flush=True)
dist.destroy_process_group()
"""


def test_two_machines_on_localhost_meet_at_a_c10d_rendezvous(tmp_path):
    """Two torchrun agents (--nnodes 2), one worker each, all-reduce over gloo: 1 + 2 = 3 on both."""
    (tmp_path / "allreduce_worker.py").write_text(ALLREDUCE_WORKER)
    endpoint = f"127.0.0.1:{_free_port()}"
    lines: dict[int, list[str]] = {0: [], 1: []}
    errors: dict[int, BaseException] = {}

    def agent(node_rank: int) -> None:
        parallel = ParallelConfig(nnodes=2, node_rank=node_rank, rdzv_endpoint=endpoint, rdzv_id="localhost-test")
        try:
            run_streaming(torchrun_command_for(parallel, "allreduce_worker", []), lines[node_rank].append,
                          timeout_s=120, env={"PYTHONPATH": str(tmp_path)})
        except BaseException as err:  # reported below, from the test's thread
            errors[node_rank] = err

    agents = [threading.Thread(target=agent, args=(rank,)) for rank in (0, 1)]
    for thread in agents:
        thread.start()
    for thread in agents:
        thread.join()
    assert not errors, errors
    results = {node: [line for line in lines[node] if ": sum" in line] for node in (0, 1)}
    assert all(len(found) == 1 for found in results.values()), lines  # one worker per agent
    assert sorted(results[0] + results[1]) == ["rank 0 of 2: sum 3", "rank 1 of 2: sum 3"]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_torchrun_failures_report_the_worker_error_not_the_launcher(tmp_path):
    script = tmp_path / "boom_worker.py"
    script.write_text("raise RuntimeError('tokenizer has no pad token')\n")
    cmd = torchrun_command("boom_worker", [], nproc_per_node=1)
    with pytest.raises(WorkerError) as err:
        run_streaming(cmd, lambda line: None, env={"PYTHONPATH": str(tmp_path)})
    assert "RuntimeError: tokenizer has no pad token" in str(err.value)
    assert "ChildFailedError" not in str(err.value)


def test_the_error_reported_is_the_failing_rank_s_not_that_of_a_peer_left_in_a_collective():
    """Ranks print their tracebacks at once (interleaved lines) and the rank left waiting fails second with a
    closed connection; the report names the first rank's error whatever the order of the lines."""
    from collections import deque

    from twinkle_core.launch import _error_summary

    lines = ["[rank1]: Traceback (most recent call last):", "[rank0]: Traceback (most recent call last):",
             "[rank1]:   File \"recipe.py\", line 12, in train", "[rank0]:   File \"recipe.py\", line 10, in train",
             "[rank0]: ValueError: rank 0 failed on purpose",
             "[rank1]: RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:25474.",
             "W1205 api.py:1028] Sending process 28598 closing signal SIGTERM"]
    assert _error_summary(deque(lines)).splitlines() == [lines[1], lines[3], lines[4]]
    for order in (lines, lines[1:2] + lines[3:5] + lines[0:1] + lines[2:3] + lines[5:]):
        assert _error_summary(deque(order)).endswith("ValueError: rank 0 failed on purpose")


def test_without_a_worker_traceback_the_report_is_the_lines_before_the_launcher_s():
    """Only torchrun's own traceback (a worker that died without one): the lines that led up to it."""
    from collections import deque

    from twinkle_core.launch import _error_summary

    lines = ["rank 0 starts", "Killed", "Traceback (most recent call last):",
             '  File "torch/distributed/run.py", line 9, in main', "torch.distributed.elastic.ChildFailedError"]
    assert _error_summary(deque(lines)).splitlines() == ["rank 0 starts", "Killed"]
