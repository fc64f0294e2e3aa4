"""Suite-wide: one thread per process, and the longest test files run first.

`make test` hands whole files to 2 xdist workers in collection order (`--dist loadfile`). A long file
collected last leaves one worker busy while the other idles, so the files that take longest (measured
with --durations on 2 cores) are moved to the front; everything else keeps pytest's order.
"""
from __future__ import annotations

import os

# One OpenMP thread per process, before anything imports torch. `make test` runs 2 xdist workers on 2 cores,
# each starting training workers of its own: with torch's default of one thread per core, OpenMP threads
# spin waiting for cores the other processes hold. Measured on 2 busy cores, 8 tests of
# tests/models/test_families_train.py on 2 workers: 55 s with 2 threads a process, 31 s with 1.
# The workers' own choice (twinkle_core.launch.cpu_threads_env) keeps a value set here.
os.environ.setdefault("OMP_NUM_THREADS", "1")

LONGEST_FIRST = [
    "tests/flows/test_families_sft.py",
    "tests/ops/test_resume.py",
    "tests/parallel/test_parallel_ep.py",
    "tests/flows/test_untested_families.py",
    "tests/ops/test_prefect_ops.py",
    "tests/parallel/test_parallel_equivalence.py",
    "tests/models/test_families_train.py",
    "tests/parallel/test_parallel_sp.py",
    "tests/parallel/test_parallel_tp.py",
    "tests/flows/test_pretrain_flow.py",
    "tests/flows/test_multi_lora_flow.py",
    "tests/megatron/test_megatron_model.py",
]


def pytest_collection_modifyitems(session, config, items):
    rank = {path: index for index, path in enumerate(LONGEST_FIRST)}
    root = config.rootpath

    def key(item):
        path = item.path.relative_to(root).as_posix() if item.path.is_relative_to(root) else str(item.path)
        return rank.get(path, len(rank))

    items.sort(key=key)  # stable: the order within a file, and of the other files, is kept
