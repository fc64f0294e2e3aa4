"""Parallel strategies, the device mesh and the parallel settings."""
from twinkle_core.parallel.config import (ParallelConfig, Strategy, check_implemented, check_parallel_config,
                                          parse_strategy, worker_mesh, world_size_from_env)
from twinkle_core.parallel.data import local_micro_batches, local_rows
from twinkle_core.parallel.mesh import DeviceMesh, validate_mesh_sizes
from twinkle_core.parallel.process_group import close_distributed, init_distributed, is_main_process
from twinkle_core.parallel.strategy import SingleProcess, build_strategy

__all__ = [
    "DeviceMesh", "ParallelConfig", "SingleProcess", "Strategy", "build_strategy", "check_implemented",
    "check_parallel_config", "close_distributed", "init_distributed", "is_main_process",
    "local_micro_batches", "local_rows", "parse_strategy", "validate_mesh_sizes", "worker_mesh",
    "world_size_from_env",
]
