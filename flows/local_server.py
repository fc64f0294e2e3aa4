"""The temporary Prefect server of a local run ends with the command that started it, however that ends.

Prefect starts it (uvicorn serving prefect.server.api.server, a child process) when a run first needs an API,
and stops it at exit; a command killed hard (SIGKILL, the OOM killer) never gets there, and the server would
stay, holding its port and its database. On Linux the kernel sends it SIGTERM when our main thread ends
(PR_SET_PDEATHSIG); elsewhere, or if another thread starts it (the signal follows the thread that forked), a
watchdog thread inside the server stops it once its parent is gone.
"""
from __future__ import annotations

import ctypes
import functools
import os
import signal
import subprocess
import sys
import threading

_PR_SET_PDEATHSIG = 1

# Run as `python -c _WATCHDOG PARENT_PID MODULE ARGS...`: MODULE as `-m` would, until PARENT_PID is not its parent.
_WATCHDOG = """\
import os, runpy, signal, sys, threading, time
parent = int(sys.argv.pop(1))
def watch():
    while os.getppid() == parent:
        time.sleep(0.5)
    os.kill(os.getpid(), signal.SIGTERM)
threading.Thread(target=watch, daemon=True).start()
runpy.run_module(sys.argv.pop(1), run_name="__main__", alter_sys=True)
"""


def end_server_with_this_process() -> None:
    """Have Prefect start its temporary server (if it starts one) tied to this process."""
    from prefect.server.api import server

    # the module's own name for subprocess: its one Popen is the server's; nothing else in the process changes
    if not isinstance(server.subprocess, _TiedSubprocess):
        server.subprocess = _TiedSubprocess()


class _TiedSubprocess:
    """The subprocess module, whose Popen starts a child that ends when this process does."""

    def __getattr__(self, name: str):
        return getattr(subprocess, name)

    @staticmethod
    def Popen(args: list[str], **kwargs) -> subprocess.Popen:  # noqa: N802 - stands in for subprocess.Popen
        if sys.platform == "linux" and threading.current_thread() is threading.main_thread():
            prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here: the forked child only calls it
            return subprocess.Popen(args, preexec_fn=functools.partial(_die_with, os.getpid(), prctl), **kwargs)
        return subprocess.Popen(watched(args), **kwargs)


def _die_with(parent: int, prctl) -> None:
    """In the child, before exec: SIGTERM when the parent's main thread ends."""
    prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:  # the parent died before prctl
        os._exit(1)


def watched(args: list[str]) -> list[str]:
    """`python -m MODULE ARGS...` run under the watchdog of this process (another command as it is)."""
    if len(args) < 3 or args[1] != "-m":
        return list(args)
    python, _, module, *rest = args
    return [python, "-c", _WATCHDOG, str(os.getpid()), module, *rest]
