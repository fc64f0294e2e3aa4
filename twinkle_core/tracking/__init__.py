"""MLflow logging and registry helpers (the one place metrics go through)."""
from twinkle_core.tracking.links import LOSS_CURVE, artifact_url, mlflow_ui_url, plot_loss_curve, run_url
from twinkle_core.tracking.logger import MetricsLogger, redact, tracking_uri
from twinkle_core.tracking.registry import RegistrationResult, register_version

__all__ = ["LOSS_CURVE", "MetricsLogger", "RegistrationResult", "artifact_url", "mlflow_ui_url", "plot_loss_curve",
           "redact", "register_version", "run_url", "tracking_uri"]
