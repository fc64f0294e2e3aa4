"""Held-out evaluation of base and trained models."""
from twinkle_core.evaluate.run import EvalRunConfig, ModelReport, evaluate_model

__all__ = ["EvalRunConfig", "ModelReport", "evaluate_model"]
