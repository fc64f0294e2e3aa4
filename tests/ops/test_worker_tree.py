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


# A recipe whose rank 0 fails while rank 1 waits for it in a collective (as a rank whose backward raises
# leaves the others inside the backward's all-reduce).
FAILING_RECIPE = """
import torch, torch.distributed as dist
from twinkle_core.parallel.process_group import close_distributed, init_distributed
from twinkle_core.train.recipe import run_recipe

class Recipe:
    def setup(self):
        init_distributed()
    def train(self):
        if dist.get_rank() == 0:
            raise ValueError("rank 0 failed on purpose")
        dist.all_reduce(torch.ones(1))
    def save_checkpoint(self):
        pass
    def cleanup(self):
        close_distributed()

run_recipe(Recipe())
"""


def test_a_rank_that_fails_ends_the_run_with_its_error_instead_of_hanging(tmp_path):
    (tmp_path / "failing_recipe.py").write_text(FAILING_RECIPE)
    started = time.monotonic()
    with pytest.raises(WorkerError, match="rank 0 failed on purpose"):
        run_streaming(torchrun_command("failing_recipe", [], nproc_per_node=2), lambda line: None, timeout_s=120,
                      env={"PYTHONPATH": os.pathsep.join([str(tmp_path), str(Path(__file__).parents[2])])})
    assert time.monotonic() - started < 60  # it used to wait at the exit barrier until the run's timeout
