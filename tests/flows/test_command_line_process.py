"""The flows' commands as a user runs them, in their own process: a mistyped option or a dataset that cannot be
read is refused in seconds with one message (no usage, no traceback, no Prefect server), and the temporary
Prefect server a run starts ends with the command, even one killed with SIGKILL."""
from __future__ import annotations

import importlib
import json
import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import psutil
import pytest

from flows.cli import parse_config
from flows.sft import SFTConfig
from tiny_models import save_tiny_model

ROOT = Path(__file__).resolve().parents[2]
CHAT_ROW = json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello."}]})


def _env(tmp_path: Path) -> dict:
    """No Prefect API configured (a run starts its temporary server), every store under tmp_path."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    # Prefect gives its temporary server 20 s to answer; under the suite's load on 2 cores it can need more
    # (the harness in tests/flows/conftest.py allows 120 s for the same reason).
    return {**env, "PREFECT_HOME": str(tmp_path / "prefect"), "TWINKLE_CACHE": str(tmp_path / "cache"),
            "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}",
            "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120"}


def _command(tmp_path: Path, module: str, *argv: str) -> tuple[subprocess.CompletedProcess, float]:
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", module, *argv], cwd=ROOT, env=_env(tmp_path), capture_output=True,
                          text=True, timeout=120)
    return done, time.monotonic() - started


@pytest.mark.parametrize("module", ["sft", "dpo", "grpo", "embedding", "pretrain", "multi_lora", "convert", "chat",
                                    "export"])
def test_every_command_names_an_unknown_option_and_the_closest_ones(module):
    with pytest.raises(SystemExit) as raised:
        importlib.import_module(f"flows.{module}").main(["--model-idd", "x", "--learning-rate", "1e-4"])
    lines = str(raised.value).splitlines()
    assert ": unknown option --model-idd; did you mean --model" in lines[0]  # --model-id, or chat's --model
    assert lines[1].startswith("unknown option --learning-rate")
    assert lines[-1] == "(--help lists every option)" and len(lines) == 3
    if module not in ("multi_lora", "convert", "chat", "export"):  # multi_lora's lr is per tenant
        assert lines[1] == "unknown option --learning-rate; did you mean --lr?"


def test_a_mistyped_option_is_one_short_error_in_seconds(tmp_path):
    done, seconds = _command(tmp_path, "flows.sft", "--learning-rate", "1e-4")
    assert done.returncode == 1  # as the options' other errors
    assert ("python -m flows.sft: unknown option --learning-rate; did you mean --lr?\n"
            "(--help lists every option)\n") in done.stderr
    assert "usage:" not in done.stderr and "Traceback" not in done.stderr
    assert seconds < 60, seconds  # imports included, on 2 busy cores (see the next test)


def test_an_unreadable_dataset_is_refused_before_the_prefect_server_starts(tmp_path):
    (tmp_path / "rows.txt").write_text(CHAT_ROW + "\n")
    (tmp_path / "empty.jsonl").write_bytes(b"")
    done, seconds = _command(tmp_path, "flows.sft", "--dataset", str(tmp_path / "rows.txt"),
                             "--eval-dataset", str(tmp_path / "empty.jsonl"))
    assert done.returncode == 1
    output = done.stdout + done.stderr
    assert "invalid options:\n  sft: 2 problem(s):\n" in done.stderr
    assert f"'{tmp_path / 'rows.txt'}' is not one of .jsonl, .json, .parquet" in done.stderr
    assert f"'{tmp_path / 'empty.jsonl'}' is empty (0 bytes)" in done.stderr
    assert "Traceback" not in output and "temporary server" not in output
    # The refusal itself takes under a second (tests/flows/test_bad_inputs.py times it in process); this bounds
    # the command with its imports, which take 20-30 s on 2 busy cores, against the server's 35 s and more.
    assert seconds < 60, seconds


def test_a_folder_holding_one_data_file_is_still_a_dataset(tmp_path):
    (tmp_path / "data" / "train").mkdir(parents=True)
    (tmp_path / "data" / "README.md").write_text("a hub snapshot's folder\n")
    (tmp_path / "data" / "train" / "rows.jsonl").write_text(CHAT_ROW + "\n")
    assert parse_config(SFTConfig, ["--dataset", str(tmp_path / "data")], "d").dataset == str(tmp_path / "data")


_SPAWN = """
import subprocess, sys, threading, time
from flows.local_server import _TiedSubprocess

def start():
    child = _TiedSubprocess.Popen([sys.executable, "-m", "http.server", "0", "--bind", "127.0.0.1"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    print(child.pid, flush=True)

if sys.argv[1] == "thread":  # the watchdog: a parent-death signal would follow this short-lived thread
    thread = threading.Thread(target=start)
    thread.start()
    thread.join()
else:
    start()
time.sleep(120)
"""


@pytest.mark.parametrize("starter", ["main", "thread"])
def test_a_tied_child_ends_when_its_parent_is_killed(starter):
    parent = subprocess.Popen([sys.executable, "-c", textwrap.dedent(_SPAWN), starter], cwd=ROOT,
                              stdout=subprocess.PIPE, text=True)
    child = psutil.Process(int(parent.stdout.readline()))
    try:
        time.sleep(2)  # the starting thread has ended: the child must still run
        assert child.is_running() and child.status() != psutil.STATUS_ZOMBIE
        parent.kill()
        parent.wait()
        assert _gone(child, within=10)
    finally:
        _kill(child)


def _gone(process: psutil.Process, within: float) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            if process.status() == psutil.STATUS_ZOMBIE:  # ended; whoever adopted it has not reaped it yet
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.1)
    return False


def _kill(process: psutil.Process) -> None:
    try:
        process.kill()
    except psutil.NoSuchProcess:
        pass


def _server_of(flow: subprocess.Popen, within: float) -> tuple[psutil.Process, int]:
    """The temporary Prefect server the flow started, once it answers, and its port."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline and flow.poll() is None:
        for child in psutil.Process(flow.pid).children(recursive=True):
            try:
                argv = child.cmdline()
            except psutil.NoSuchProcess:
                continue
            if "prefect.server.api.server:create_app" in argv:
                port = int(argv[argv.index("--port") + 1])
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/api/health", timeout=2).status_code == 200:
                        return child, port
                except httpx.TransportError:
                    pass
        time.sleep(0.5)
    raise AssertionError(f"no temporary Prefect server answered within {within} s (flow exit {flow.poll()})")


def test_the_temporary_server_ends_with_a_killed_flow(tmp_path):
    model = save_tiny_model(tmp_path / "tiny-llama", "llama")
    flow = subprocess.Popen([sys.executable, "-m", "flows.sft", "--model-id", str(model), "--output-dir",
                             str(tmp_path / "runs"), "--max-steps", "1"], cwd=ROOT, env=_env(tmp_path),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    leftovers: list[psutil.Process] = []
    try:
        server, port = _server_of(flow, within=180)
        leftovers = psutil.Process(flow.pid).children(recursive=True)
        flow.kill()  # SIGKILL: no atexit, no finally
        flow.wait()
        assert _gone(server, within=10), server.cmdline()
        with socket.socket() as sock:  # nothing listens on its port any more (a new server could bind it)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("127.0.0.1", port))
    finally:
        if flow.poll() is None:
            leftovers += psutil.Process(flow.pid).children(recursive=True)
            flow.kill()
        for process in leftovers:
            _kill(process)
