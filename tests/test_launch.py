"""The worker launcher: errors carry the worker's own message; timeouts kill the whole process group."""
import sys
import time

import pytest

from twinkle_core.launch import WorkerError, run_streaming, torchrun_command


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
    multi = torchrun_command("twinkle_core.train", ["cfg.json"], 8, rdzv_endpoint="head:29500", nnodes=2)
    assert "--rdzv-endpoint=head:29500" in multi and "--nnodes=2" in multi and "--standalone" not in multi


def test_torchrun_failures_report_the_worker_error_not_the_launcher(tmp_path):
    script = tmp_path / "boom_worker.py"
    script.write_text("raise RuntimeError('tokenizer has no pad token')\n")
    cmd = torchrun_command("boom_worker", [], nproc_per_node=1)
    with pytest.raises(WorkerError) as err:
        run_streaming(cmd, lambda line: None, env={"PYTHONPATH": str(tmp_path)})
    assert "RuntimeError: tokenizer has no pad token" in str(err.value)
    assert "ChildFailedError" not in str(err.value)
