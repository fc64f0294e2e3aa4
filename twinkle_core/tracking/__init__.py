"""MLflow logging and registry helpers (the one place metrics go through)."""
from twinkle_core.tracking.logger import MetricsLogger, redact, tracking_uri
from twinkle_core.tracking.registry import RegistrationResult, register_version

__all__ = ["MetricsLogger", "RegistrationResult", "redact", "register_version", "tracking_uri"]
