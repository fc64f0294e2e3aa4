"""Run a function over a stream of chunks in worker processes, in order, with a bounded number in flight.

`map_chunks(function, chunks, num_proc)` is what the tokeniser and the corpus packer use: the chunks are read
lazily, at most `2 × num_proc` are queued or in work at a time, so the memory held is set by the chunk size
and not by the data set's size. Results come back in input order, so the output does not depend on
`num_proc`.

Workers are forked where the platform can (Linux): they inherit the loaded tokenizer and start in
milliseconds, as HF datasets' `map(num_proc=...)` does. Elsewhere they are spawned and `function` (a
module-level function or a functools.partial of one) loads what it needs once per process. A single chunk,
or num_proc=1, runs in this process: small data sets pay no process start.
"""
from __future__ import annotations

import itertools
import multiprocessing
import os
from collections import deque
from typing import Callable, Iterable, Iterator, TypeVar

Chunk = TypeVar("Chunk")
Result = TypeVar("Result")

MAX_DEFAULT_PROC = 8  # the default stops here: past it the single reader/writer, not the encoding, limits


def default_num_proc() -> int:
    """The cores this process may use, capped at MAX_DEFAULT_PROC."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(cores, MAX_DEFAULT_PROC))


def check_num_proc(num_proc: int | None) -> int:
    """`num_proc`, or the default for None; anything below 1 is refused."""
    if num_proc is None:
        return default_num_proc()
    if num_proc < 1:
        raise ValueError(f"num_proc={num_proc} must be at least 1 (or None for the machine's cores)")
    return num_proc


def _context():
    methods = multiprocessing.get_all_start_methods()
    return multiprocessing.get_context("fork" if "fork" in methods else "spawn")


def map_chunks(function: Callable[[Chunk], Result], chunks: Iterable[Chunk], num_proc: int) -> Iterator[Result]:
    """function(chunk) for every chunk, in order, in `num_proc` worker processes."""
    chunks = iter(chunks)
    head = list(itertools.islice(chunks, 2))
    if num_proc <= 1 or len(head) < 2:
        yield from map(function, itertools.chain(head, chunks))
        return
    # A forked tokenizer would warn that its thread pool was disabled; one thread per worker is what we want.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    with _context().Pool(num_proc) as pool:
        pending: deque = deque()
        for chunk in itertools.chain(head, chunks):
            pending.append(pool.apply_async(function, (chunk,)))
            if len(pending) >= 2 * num_proc:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()
