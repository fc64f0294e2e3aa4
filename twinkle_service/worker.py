"""The service's worker tree: the model lives in worker processes, never in the HTTP process.

`WorkerTree` starts `python -m twinkle_service.worker` (under torchrun for several processes) with the
project's launcher, so the tree dies with the server however it ends. Its leader (the first worker on the
server's machine) connects back over a local authenticated socket (multiprocessing.connection), receives
each call, broadcasts it to every rank, and sends the result back; every rank runs the same call on its
own engine (its share of the rows; the gradients summed across ranks before each step, see engine.py).
Other machines join the tree with `join_tree` (`python -m flows.service --node-rank N`). `RemoteEngine`
is the HTTP side's view of it, with the engine's own methods.
"""
from __future__ import annotations

import argparse
import logging
import os
import secrets
import threading
import traceback
from multiprocessing.connection import Client, Listener
from types import SimpleNamespace

from twinkle_core.errors import UserError
from twinkle_core.launch import WorkerError, run_streaming, torchrun_command_for

logger = logging.getLogger(__name__)

AUTHKEY_ENV = "TWINKLE_SERVICE_AUTHKEY"
CALLS = ("forward_backward", "create", "remove", "optim_step", "save_sampler", "drop_sampler", "sample",
         "save_state", "load_state", "create_from_state")


class RemoteEngine:
    """The engine in the worker tree, called from the HTTP process's engine thread (one call at a time)."""

    def __init__(self, tree: "WorkerTree"):
        self._tree = tree

    def forward_backward(self, requests):
        return self._tree.call("forward_backward", requests)

    def __getattr__(self, kind: str):
        if kind not in CALLS:
            raise AttributeError(kind)
        return lambda **kw: self._tree.call(kind, kw)

    def close(self) -> None:
        self._tree.close()


class WorkerTree:
    def __init__(self, model_id: str, max_tenants: int, max_rank: int, max_length: int, mixed_precision: str,
                 nproc_per_node: int = 1, start_timeout_s: float = 600.0, backend: str = "transformers",
                 tp_size: int = 1, fsdp: bool = False, nnodes: int = 1, rdzv_endpoint: str | None = None,
                 rdzv_id: str = "twinkle"):
        """`nnodes` > 1: this machine is node 0 of the tree; the others join it (`join_tree`) at `rdzv_endpoint`."""
        authkey = secrets.token_bytes(32)
        self._listener = Listener(("127.0.0.1", 0), authkey=authkey)
        host, port = self._listener.address
        args = worker_args(model_id, max_tenants, max_rank, max_length, mixed_precision, backend, tp_size, fsdp,
                           connect=f"{host}:{port}")
        cmd = _command(args, nproc_per_node, nnodes, 0, rdzv_endpoint, rdzv_id)
        self.exit_error: str | None = None
        self._lock = threading.Lock()
        env = {AUTHKEY_ENV: authkey.hex(), "TINKER_TELEMETRY": "0"}
        self._thread = threading.Thread(target=self._run, args=(cmd, env), name="twinkle-workers", daemon=True)
        self._thread.start()
        self._conn = self._accept(start_timeout_s)
        status, value = self._conn.recv()  # the model is loaded on every rank
        if status != "ready":
            raise WorkerError(f"the workers failed to start: {value}")

    def _run(self, cmd: list[str], env: dict) -> None:
        try:
            run_streaming(cmd, lambda line: logger.info("[workers] %s", line), env=env)
        except WorkerError as exc:
            self.exit_error = str(exc)
        else:
            self.exit_error = "the workers exited"
        finally:
            self._listener.close()  # wakes a pending accept

    def _accept(self, timeout_s: float):
        accepted: list = []
        thread = threading.Thread(target=lambda: accepted.append(self._listener.accept()), daemon=True)
        thread.start()
        thread.join(timeout_s)
        if not accepted:
            raise WorkerError(self.exit_error or f"the workers did not connect within {timeout_s:.0f} s")
        return accepted[0]

    def call(self, kind: str, args):
        with self._lock:
            if self.exit_error:
                raise WorkerError(self.exit_error)
            try:
                self._conn.send((kind, args))
                status, value = self._conn.recv()
            except (EOFError, OSError):
                self._thread.join(timeout=10)
                raise WorkerError(self.exit_error or "the workers stopped") from None
        if status == "user":
            raise UserError(value)
        if status != "ok":
            raise WorkerError(value)
        return value

    def close(self) -> None:
        with self._lock:
            try:
                self._conn.send(("stop", None))
            except OSError:
                pass
        self._thread.join(timeout=30)


def worker_args(model_id: str, max_tenants: int, max_rank: int, max_length: int, mixed_precision: str,
                backend: str, tp_size: int, fsdp: bool, connect: str | None) -> list[str]:
    return ["--model-id", model_id, "--max-tenants", str(max_tenants), "--max-rank", str(max_rank),
            "--max-length", str(max_length), "--mixed-precision", mixed_precision, "--backend", backend,
            "--tp-size", str(tp_size), *(["--fsdp"] if fsdp else []), *(["--connect", connect] if connect else [])]


def _command(args: list[str], nproc_per_node: int, nnodes: int, node_rank: int, rdzv_endpoint: str | None,
             rdzv_id: str) -> list[str]:
    launch = SimpleNamespace(nproc_per_node=nproc_per_node, nnodes=nnodes, node_rank=node_rank,
                             rdzv_endpoint=rdzv_endpoint, rdzv_id=rdzv_id, max_restarts=0)
    return torchrun_command_for(launch, "twinkle_service.worker", args)


def join_tree(args: list[str], nproc_per_node: int, nnodes: int, node_rank: int, rdzv_endpoint: str,
              rdzv_id: str = "twinkle") -> None:
    """Run this machine's workers of a tree whose node 0 serves HTTP (`worker_args` without `connect`: the
    leader is on node 0); returns when the server stops them."""
    run_streaming(_command(args, nproc_per_node, nnodes, node_rank, rdzv_endpoint, rdzv_id),
                  lambda line: logger.info("[workers] %s", line), env={"TINKER_TELEMETRY": "0"})


# ----- the worker side -------------------------------------------------------------------------------
def _serve(engine, conn, world: int, leader: int) -> None:
    import torch.distributed as dist

    while True:
        if conn is not None:
            try:
                message = conn.recv()
            except EOFError:  # the server went away
                message = ("stop", None)
        else:
            message = None
        if world > 1:
            box = [message]
            dist.broadcast_object_list(box, src=leader)
            message = box[0]
        kind, args = message
        if kind == "stop":
            return
        try:
            if kind not in CALLS:
                raise RuntimeError(f"unknown call {kind!r}")
            method = getattr(engine, kind)
            reply = ("ok", method(args) if kind == "forward_backward" else method(**args))
        except UserError as exc:
            reply = ("user", str(exc))
        except Exception as exc:
            logger.error("call %s failed:\n%s", kind, traceback.format_exc())
            reply = ("server", f"{type(exc).__name__}: {exc}")
        if conn is not None:
            conn.send(reply)


def _engine(args):
    if args.backend == "megatron":
        from twinkle_service.megatron_engine import MegatronEngine

        return MegatronEngine(args.model_id, args.max_tenants, args.max_rank, args.max_length, args.mixed_precision,
                              tp_size=args.tp_size)
    if args.fsdp:
        from twinkle_service.sharded_engine import ShardedEngine

        return ShardedEngine(args.model_id, args.max_tenants, args.max_rank, args.max_length, args.mixed_precision)
    from twinkle_service.transformers_engine import TransformersEngine

    return TransformersEngine(args.model_id, args.max_tenants, args.max_rank, args.max_length, args.mixed_precision)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model-id", required=True)
    parser.add_argument("--max-tenants", type=int, required=True)
    parser.add_argument("--max-rank", type=int, required=True)
    parser.add_argument("--max-length", type=int, required=True)
    parser.add_argument("--mixed-precision", default="auto")
    parser.add_argument("--backend", choices=("transformers", "megatron"), default="transformers")
    parser.add_argument("--tp-size", type=int, default=1)
    parser.add_argument("--fsdp", action="store_true")
    parser.add_argument("--connect", default=None, help="HOST:PORT of the server (its machine's first worker)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        from twinkle_core.parallel.process_group import init_distributed

        init_distributed()
    # The leader talks to the server: the first worker of the server's machine (rendezvous gives rank 0 to any
    # machine), the one that was given the server's address and key.
    here = args.connect is not None and AUTHKEY_ENV in os.environ and int(os.environ.get("LOCAL_RANK", "0")) == 0
    leader = 0
    if world > 1:
        import torch.distributed as dist

        flags: list = [None] * world
        dist.all_gather_object(flags, here)
        if True not in flags:
            raise RuntimeError("no worker of this tree runs on the server's machine (node 0 starts with the server)")
        leader = flags.index(True)
    conn = None
    if int(os.environ.get("RANK", "0")) == leader:
        host, port = args.connect.rsplit(":", 1)
        conn = Client((host, int(port)), authkey=bytes.fromhex(os.environ[AUTHKEY_ENV]))
    try:
        engine = _engine(args)
    except Exception as exc:
        if conn is not None:
            conn.send(("failed", f"{type(exc).__name__}: {exc}"))
        raise
    if conn is not None:
        conn.send(("ready", engine.vocab_size))
    _serve(engine, conn, world, leader)


if __name__ == "__main__":
    main()
