"""train: launch the training workers with torchrun and follow them."""
from __future__ import annotations

import json
from pathlib import Path

from prefect import get_run_logger, task
from prefect.artifacts import create_progress_artifact, update_progress_artifact

from tasks.refs import CheckpointRef
from twinkle_core.launch import cpu_threads_env, run_streaming, torchrun_command_for
from twinkle_core.train import TrainRunConfig
from twinkle_core.train.recipe import EVENT_PREFIX


def step_metrics(event: dict) -> dict[str, float]:
    """The numbers of a step event, plus the run's total tokens/s (every rank trains at about its rate)."""
    metrics = {k: float(event[k]) for k in ("loss", "grad_norm", "lr", "tokens_per_s", "tokens_per_s_total", "mfu",
                                            "peak_memory_mb") if k in event}
    if "tokens_per_s_total" not in metrics and "tokens_per_s" in metrics:
        metrics["tokens_per_s_total"] = metrics["tokens_per_s"] * int(event.get("world_size", 1))
    return metrics


def describe_step(event: dict) -> str:
    """One log line per step; the performance parts only where the workers reported them."""
    m = step_metrics(event)
    parts = [f"step {event['step']}/{event['total']} loss {m['loss']:.4f} lr {m['lr']:.2e} "
             f"grad_norm {m['grad_norm']:.3f}"]
    if "tokens_per_s" in m:
        parts.append(f"{m['tokens_per_s']:.0f} tokens/s per rank, {m['tokens_per_s_total']:.0f} total")
    if "mfu" in m:
        parts.append(f"MFU {100 * m['mfu']:.1f}%")
    if "peak_memory_mb" in m:
        parts.append(f"peak memory {m['peak_memory_mb']:.0f} MB")
    return ", ".join(parts)


class _Follower:
    """Turns worker output into Prefect log lines, progress and the final checkpoint event."""

    def __init__(self):
        self.log = get_run_logger()
        self.progress_id = create_progress_artifact(progress=0.0, description="training steps")
        self.events: dict[str, dict] = {}

    def __call__(self, line: str) -> None:
        if not line.startswith(EVENT_PREFIX):
            self.log.info(line)
            return
        event = json.loads(line[len(EVENT_PREFIX):])
        self.events[event["event"]] = event
        if event["event"] == "step":
            update_progress_artifact(self.progress_id, 100.0 * event["step"] / event["total"])
            self.log.info(describe_step(event))
        else:
            self.log.info("%s: %s", event["event"], event)


@task
def train(run_config: TrainRunConfig, run_dir: str, timeout_s: float | None = None) -> CheckpointRef | None:
    """Write the run config, start `torchrun -m twinkle_core.train`, stream it, return the checkpoint.

    None on a machine of a multi-machine run that did not hold global rank 0 (that machine saves it).
    """
    config_path = run_config.write(Path(run_dir) / "train_config.json")
    follow = _Follower()
    cmd = torchrun_command_for(run_config.parallel, "twinkle_core.train", [str(config_path)])
    follow.log.info("launching: %s", " ".join(cmd))
    run_streaming(cmd, follow, timeout_s=timeout_s, env=cpu_threads_env(run_config.parallel.nproc_per_node))
    done = follow.events.get("checkpoint")
    if done is None and run_config.parallel.nnodes > 1:
        follow.log.info("training finished; global rank 0 ran on another machine, which saved the checkpoint")
        return None
    if done is None:
        raise RuntimeError("training finished without writing a checkpoint; see the worker log above.")
    metrics = step_metrics(follow.events.get("step", {}))
    return CheckpointRef(path=done["path"], is_adapter=run_config.use_lora, final_metrics=metrics,
                         train_seconds=done["train_seconds"], probe_loss=done["probe_loss"])
