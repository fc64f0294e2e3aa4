"""The training entry point and its run configuration."""
from twinkle_core.train.config import TrainRunConfig

__all__ = ["TrainRunConfig"]
