"""train: launch the training workers with torchrun and follow them."""
from __future__ import annotations

import json
from pathlib import Path

from prefect import get_run_logger, task
from prefect.artifacts import create_progress_artifact, update_progress_artifact

from tasks.refs import CheckpointRef
from twinkle_core.launch import run_streaming, torchrun_command
from twinkle_core.train import TrainRunConfig
from twinkle_core.train.recipe import EVENT_PREFIX


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
            self.log.info("step %d/%d loss %.4f lr %.2e grad_norm %.3f %.0f tokens/s", event["step"],
                          event["total"], event["loss"], event["lr"], event["grad_norm"], event["tokens_per_s"])
        else:
            self.log.info("%s: %s", event["event"], event)


@task
def train(run_config: TrainRunConfig, run_dir: str, timeout_s: float | None = None) -> CheckpointRef:
    """Write the run config, start `torchrun -m twinkle_core.train`, stream it, return the checkpoint."""
    config_path = run_config.write(Path(run_dir) / "train_config.json")
    follow = _Follower()
    cmd = torchrun_command("twinkle_core.train", [str(config_path)], run_config.parallel.nproc_per_node)
    follow.log.info("launching: %s", " ".join(cmd))
    run_streaming(cmd, follow, timeout_s=timeout_s)
    done = follow.events.get("checkpoint")
    if done is None:
        raise RuntimeError("training finished without writing a checkpoint; see the worker log above.")
    last = follow.events.get("step", {})
    metrics = {k: float(last[k]) for k in ("loss", "grad_norm", "lr", "tokens_per_s") if k in last}
    return CheckpointRef(path=done["path"], is_adapter=run_config.use_lora, final_metrics=metrics,
                         train_seconds=done["train_seconds"], probe_loss=done["probe_loss"])
