"""The recipe's batch prefetcher: the same batches in the same order, errors raised where they belong."""
from __future__ import annotations

import itertools
import threading
import time

import pytest

from twinkle_core.train.prefetch import Prefetcher


def test_yields_every_item_in_order_and_stays_exhausted():
    items = Prefetcher(({"step": i} for i in range(50)), depth=3)
    assert list(items) == [{"step": i} for i in range(50)]
    assert list(items) == []


def test_reads_ahead_while_the_consumer_works_but_no_further_than_its_depth():
    produced = []

    def slow_source():
        for i in itertools.count():
            produced.append(i)
            yield i

    items = Prefetcher(slow_source(), depth=2)
    assert next(items) == 0
    time.sleep(0.3)  # the consumer is busy: the producer fills the queue, then waits
    assert len(produced) <= 4  # item 0 taken, 2 queued, 1 waiting to be put
    assert [next(items) for _ in range(5)] == [1, 2, 3, 4, 5]
    items.close()


def test_an_error_of_the_source_is_raised_at_its_place_in_the_order():
    def failing():
        yield 1
        yield 2
        raise ValueError("row 3 is bad")

    items = Prefetcher(failing())
    assert next(items) == 1 and next(items) == 2
    with pytest.raises(ValueError, match="row 3 is bad"):
        next(items)


def test_close_ends_the_thread_of_an_endless_source():
    before = threading.active_count()
    items = Prefetcher(itertools.count(), depth=1)
    assert next(items) == 0
    items.close()
    time.sleep(0.3)
    assert threading.active_count() == before
    with pytest.raises(ValueError, match="depth=0"):
        Prefetcher([], depth=0)
