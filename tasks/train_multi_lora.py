"""train_tenants: launch the multi-tenant LoRA workers with torchrun and follow every tenant's progress."""
from __future__ import annotations

import json
from pathlib import Path

from prefect import get_run_logger, task

from tasks.refs import CheckpointRef
from tasks.train import describe_step, launch_workers, step_metrics
from twinkle_core.train.multi_lora_config import MultiLoraRunConfig
from twinkle_core.train.recipe import EVENT_PREFIX


class _TenantFollower:
    """Worker output to Prefect log lines; remembers each tenant's last step, checkpoint and failure."""

    def __init__(self):
        self.log = get_run_logger()
        self.steps: dict[str, dict] = {}
        self.checkpoints: dict[str, dict] = {}
        self.failures: dict[str, str] = {}

    def __call__(self, line: str) -> None:
        if not line.startswith(EVENT_PREFIX):
            self.log.info(line)
            return
        event = json.loads(line[len(EVENT_PREFIX):])
        kind, tenant = event["event"], event.get("tenant")
        if kind == "tenant_step":
            self.steps[tenant] = event
            self.log.info("[%s] %s", tenant, describe_step(event))
        elif kind == "tenant_checkpoint":
            self.checkpoints[tenant] = event
        elif kind == "tenant_failed":
            self.failures[tenant] = event["error"]
            self.log.error("[%s] failed: %s", tenant, event["error"])
        if kind != "tenant_step":
            self.log.info("%s: %s", kind, event)


@task
def train_tenants(run_config: MultiLoraRunConfig, run_dir: str, timeout_s: float | None = None,
                  device_limit: str | None = "gpu") -> tuple[dict[str, CheckpointRef], dict[str, str]]:
    """Write the run config, start `torchrun -m twinkle_core.train.multi_lora`; return checkpoints and failures."""
    config_path = run_config.write(Path(run_dir) / "multi_lora_config.json")
    follow = _TenantFollower()
    launch_workers(run_config.parallel, "twinkle_core.train.multi_lora", config_path, follow, timeout_s, device_limit)
    checkpoints = {
        name: CheckpointRef(path=done["path"], is_adapter=True, final_metrics=step_metrics(follow.steps.get(name, {})),
                            train_seconds=done["train_seconds"], probe_loss=done["probe_loss"])
        for name, done in follow.checkpoints.items()
    }
    return checkpoints, follow.failures
