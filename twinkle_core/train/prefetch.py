"""Prepare the next batches in a background thread while the current step runs (the DataLoader's prefetch,
without worker processes: the rows are memory-mapped and collating them is cheap, it only has to overlap)."""
from __future__ import annotations

import queue
import threading
from collections.abc import Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")
_END = object()


class Prefetcher(Iterator[T]):
    """Iterates `items` in a daemon thread, at most `depth` ahead; the consumer sees the same items in the same
    order, and an error raised while producing one is raised at the consumer when it reaches that item."""

    def __init__(self, items: Iterable[T], depth: int = 2):
        if depth < 1:
            raise ValueError(f"depth={depth!r} must be at least 1")
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._produce, args=(iter(items),), name="prefetch", daemon=True)
        self._thread.start()

    def _produce(self, items: Iterator[T]) -> None:
        try:
            for item in items:
                if not self._put((item, None)):
                    return
        except BaseException as error:  # handed to the consumer, which raises it in its own thread
            self._put((_END, error))
            return
        self._put((_END, None))

    def _put(self, entry) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(entry, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def __next__(self) -> T:
        item, error = self._queue.get()
        if item is _END:
            self._queue.put((_END, error))  # stay exhausted
            if error is not None:
                raise error
            raise StopIteration
        return item

    def close(self) -> None:
        """Stop producing (the thread ends within 0.1 s)."""
        self._stop.set()
