"""MLflow logging and registry helpers (the one place metrics go through).

The registry helpers import mlflow (about 1.3 s); they load on first use, so the training and evaluation
workers, which only log through MetricsLogger (itself lazy), start without it.

MLflow's usage telemetry is off unless MLFLOW_DISABLE_TELEMETRY is set: runs are offline by default, and
its sender thread tries the network from every process that logs (and holds the process at exit).
"""
import os

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")  # read when the first client starts

from twinkle_core.tracking.links import LOSS_CURVE, artifact_url, mlflow_ui_url, plot_loss_curve, run_url
from twinkle_core.tracking.logger import MetricsLogger, redact, tracking_uri

__all__ = ["LOSS_CURVE", "MetricsLogger", "RegistrationResult", "artifact_url", "load_registered", "mlflow_ui_url",
           "plot_loss_curve", "redact", "register_version", "run_url", "tracking_uri"]


def __getattr__(name: str):
    if name in ("RegistrationResult", "register_version"):
        from twinkle_core.tracking import registry

        return getattr(registry, name)
    if name == "load_registered":
        from twinkle_core.tracking.registered import load_registered

        return load_registered
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
