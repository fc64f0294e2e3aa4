"""train: launch the training workers with torchrun and follow them.

Training holds `nproc_per_node` slots of a Prefect global concurrency limit (default name "gpu") while it
runs, so runs started together queue for the devices instead of fighting over them; without such a limit
on the server nothing waits. Cancelling the flow run or passing the timeout kills the whole worker tree
(twinkle_core.launch).
"""
from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

from prefect import get_run_logger, task
from prefect.artifacts import create_progress_artifact, update_progress_artifact
from prefect.concurrency.sync import concurrency

from tasks.refs import CheckpointRef
from twinkle_core.launch import cpu_allocator_env, cpu_threads_env, run_streaming, torchrun_command_for
from twinkle_core.train import TrainRunConfig
from twinkle_core.train.pretrain import PretrainRunConfig
from twinkle_core.train.recipe import EVENT_PREFIX


def step_metrics(event: dict) -> dict[str, float]:
    """The numbers of a step event, plus the run's total tokens/s (every rank trains at about its rate)."""
    metrics = {k: float(event[k]) for k in ("loss", "grad_norm", "lr", "tokens_per_s", "tokens_per_s_total", "mfu",
                                            "peak_memory_mb") if k in event}
    if "tokens_per_s_total" not in metrics and "tokens_per_s" in metrics:
        metrics["tokens_per_s_total"] = metrics["tokens_per_s"] * int(event.get("world_size", 1))
    # An objective's own metrics (the preference objective's rewards/accuracy, GRPO's reward, kl, ...).
    metrics.update({k: float(v) for k, v in event.items()
                    if k not in metrics and k not in ("step", "total", "world_size") and isinstance(v, (int, float))})
    return metrics


def describe_step(event: dict) -> str:
    """One log line per step; the performance parts only where the workers reported them."""
    m = step_metrics(event)
    parts = [f"step {event['step']}/{event['total']} loss {m['loss']:.4f} lr {m['lr']:.2e} "
             f"grad_norm {m['grad_norm']:.3f}"]
    if "reward" in m:
        parts.append(f"reward {m['reward']:.3f} (std {m.get('reward_std', 0.0):.3f})")
    if "rewards/accuracy" in m:
        parts.append(f"reward accuracy {m['rewards/accuracy']:.2f}, margin {m['rewards/margin']:.3f}")
    if "tokens_per_s" in m:
        parts.append(f"{m['tokens_per_s']:.0f} tokens/s per rank, {m['tokens_per_s_total']:.0f} total")
    if "mfu" in m:
        parts.append(f"MFU {100 * m['mfu']:.1f}%")
    if "peak_memory_mb" in m:
        parts.append(f"peak memory {m['peak_memory_mb']:.0f} MB")
    return ", ".join(parts)


def describe_progress(step: int, total: int, first_step: int, seconds: float) -> str:
    """'step 30/120, ETA 1 min 30 s' from the pace of the steps trained in this attempt."""
    done = step - first_step
    if done <= 0 or step >= total:
        return f"step {step}/{total}"
    eta = round(seconds / done * (total - step))
    return f"step {step}/{total}, ETA " + (f"{eta // 60} min {eta % 60} s" if eta >= 60 else f"{eta} s")


class _Follower:
    """Turns worker output into Prefect log lines, progress (step / total, ETA) and the final events."""

    UPDATE_EVERY_S = 2.0  # progress artifact updates are API calls: at most this often, and at the last step

    def __init__(self):
        self.log = get_run_logger()
        self.progress_id = create_progress_artifact(progress=0.0, key="training-progress",
                                                    description="training: starting the workers")
        self.events: dict[str, dict] = {}
        self.first_step, self.started, self.updated = 0, time.monotonic(), 0.0

    def __call__(self, line: str) -> None:
        if not line.startswith(EVENT_PREFIX):
            self.log.info(line)
            return
        event = json.loads(line[len(EVENT_PREFIX):])
        self.events[event["event"]] = event
        if event["event"] == "step":
            self._progress(event["step"], event["total"])
            self.log.info(describe_step(event))
        elif event["event"] == "resume":
            self.first_step, self.started = event["step"], time.monotonic()
            self.log.info("resumed from the training state saved at step %d of %d", event["step"], event["total"])
        else:
            if event["event"] == "perf":  # the last setup event: the pace counts from here
                self.started = time.monotonic()
            self.log.info("%s: %s", event["event"], event)

    def _progress(self, step: int, total: int) -> None:
        now = time.monotonic()
        if now - self.updated < self.UPDATE_EVERY_S and step < total:
            return
        self.updated = now
        update_progress_artifact(self.progress_id, 100.0 * step / total,
                                 description=describe_progress(step, total, self.first_step, now - self.started))


def launch_workers(parallel, entry: str, config_path: Path, follow, timeout_s: float | None,
                   device_limit: str | None) -> None:
    """torchrun `entry` on the run config, holding nproc_per_node slots of `device_limit` while it runs."""
    cmd = torchrun_command_for(parallel, entry, [str(config_path)])
    slots = parallel.nproc_per_node
    log = get_run_logger()
    if device_limit:
        log.info("taking %d slot(s) of the concurrency limit %r (waits while other runs hold them)", slots,
                 device_limit)
    with concurrency(device_limit, occupy=slots, strict=False) if device_limit else contextlib.nullcontext():
        log.info("launching: %s", " ".join(cmd))
        run_streaming(cmd, follow, timeout_s=timeout_s, env={**cpu_threads_env(slots), **cpu_allocator_env()})


@task
def train(run_config: TrainRunConfig | PretrainRunConfig, run_dir: str, timeout_s: float | None = None,
          device_limit: str | None = "gpu", entry: str = "twinkle_core.train") -> CheckpointRef | None:
    """Write the run config, start `torchrun -m <entry>` (SFT, or twinkle_core.train.pretrain), stream it,
    return the checkpoint.

    None on a machine of a multi-machine run that did not hold global rank 0 (that machine saves it).
    """
    config_path = run_config.write(Path(run_dir) / "train_config.json")
    follow = _Follower()
    launch_workers(run_config.parallel, entry, config_path, follow, timeout_s, device_limit)
    done = follow.events.get("checkpoint")
    if done is None and run_config.parallel.nnodes > 1:
        follow.log.info("training finished; global rank 0 ran on another machine, which saved the checkpoint")
        return None
    if done is None:
        raise RuntimeError("training finished without writing a checkpoint; see the worker log above.")
    metrics = step_metrics(follow.events.get("step", {}))
    metrics.update({f"eval_{k}": float(v) for k, v in follow.events.get("eval", {}).items() if k != "event"})
    return CheckpointRef(path=done["path"], is_adapter=run_config.use_lora, final_metrics=metrics,
                         train_seconds=done["train_seconds"], probe_loss=done["probe_loss"],
                         resumed_from_step=follow.events.get("resume", {}).get("step", 0))
