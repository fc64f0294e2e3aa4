"""Serve the flows as Prefect deployments: UI-triggered runs and schedules, from this machine.

    prefect server start                      # in one terminal (UI on http://127.0.0.1:4200)
    python -m deployments.deploy              # in another: serves the deployments below until stopped

Then trigger "sft/default" (or edit its parameters) from the UI, or `prefect deployment run sft/default`.
For a work pool instead of a long-lived process, see deployments/prefect.yaml (`prefect deploy --all`).
"""
from __future__ import annotations

from prefect import serve

from flows.sft import SFTConfig, sft

PRESETS = {
    # The embedded default: SmolLM2-135M-Instruct learns that it is Twinkle (about 5 minutes on 2 CPU cores).
    "default": SFTConfig(),
    # A nightly re-train of the default; the registry only promotes the result if it beats the champion.
    "nightly": SFTConfig(epochs=2),
}
SCHEDULES = {"nightly": "0 2 * * *"}


def build_deployments() -> list:
    return [
        sft.to_deployment(
            name=name, parameters={"config": config.model_dump(mode="json")}, cron=SCHEDULES.get(name),
            tags=["twinkle", "sft"], description=f"sft preset {name!r}",
        )
        for name, config in PRESETS.items()
    ]


if __name__ == "__main__":
    serve(*build_deployments())
