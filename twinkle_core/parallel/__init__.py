"""Parallel strategies and the device mesh settings."""
from twinkle_core.parallel.config import ParallelConfig, Strategy, check_single_process, parse_strategy, world_size_from_env

__all__ = ["ParallelConfig", "Strategy", "check_single_process", "parse_strategy", "world_size_from_env"]
