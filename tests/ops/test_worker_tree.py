"""The torchrun tree dies with its run: on a timeout (the same path as a cancel) and when the process that
started it is SIGKILLed. torchrun starts every worker in a session of its own, so a kill of the agent's
process group alone would leave them running."""
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from twinkle_core.launch import WorkerError, run_streaming, torchrun_command

SLEEPER = "import os, time\nprint('worker', os.getpid(), flush=True)\ntime.sleep(600)\n"


def _is_running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def _wait_gone(pids: list[int], timeout_s: float = 30) -> float:
    started = time.monotonic()
    while any(map(_is_running, pids)) and time.monotonic() - started < timeout_s:
        time.sleep(0.05)
    return time.monotonic() - started


@pytest.fixture
def sleeper_env(tmp_path):
    (tmp_path / "sleeper.py").write_text(SLEEPER)
    return {"PYTHONPATH": str(tmp_path)}


def test_a_timeout_kills_torchrun_and_every_worker(sleeper_env):
    pids = []
    on_line = lambda line: pids.append(int(line.split()[1])) if line.startswith("worker ") else None  # noqa: E731
    with pytest.raises(WorkerError, match="timeout"):
        run_streaming(torchrun_command("sleeper", [], nproc_per_node=2), on_line, timeout_s=15, env=sleeper_env)
    assert len(pids) == 2  # both workers had started (15 s is plenty for torchrun here)
    left = _wait_gone(pids, timeout_s=5)
    assert not any(map(_is_running, pids)), f"workers still running {left:.1f} s after the timeout"


def test_workers_die_when_the_launching_process_is_killed(sleeper_env, tmp_path):
    launcher = tmp_path / "launch.py"
    launcher.write_text(
        "import sys\nfrom twinkle_core.launch import run_streaming, torchrun_command\n"
        "run_streaming(torchrun_command('sleeper', [], nproc_per_node=2), lambda l: print(l, flush=True),"
        f" env={sleeper_env!r})\n")
    root = str(Path(__file__).resolve().parents[2])
    proc = subprocess.Popen([sys.executable, str(launcher)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": root})
    pids = []
    for line in proc.stdout:
        if line.startswith("worker "):
            pids.append(int(line.split()[1]))
        if len(pids) == 2:
            break
    proc.kill()  # SIGKILL: the launcher cleans nothing up
    proc.wait()
    took = _wait_gone(pids, timeout_s=30)
    print(f"workers gone {took:.1f} s after their launcher was SIGKILLed")
    assert not any(map(_is_running, pids))
