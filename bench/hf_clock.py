"""The HF side of the benchmarks: a Trainer callback that notes when each optimizer step begins and ends."""
from __future__ import annotations

import time
from typing import Callable

from transformers import TrainerCallback


class StepClock(TrainerCallback):
    """perf_counter() at the begin and end of every step, each after `sync` (the device's, so GPU work counts)."""

    def __init__(self, sync: Callable[[], None]):
        self.sync, self.begins, self.ends = sync, [], []

    def on_step_begin(self, args, state, control, **kwargs):
        self.sync()
        self.begins.append(time.perf_counter())

    def on_step_end(self, args, state, control, **kwargs):
        self.sync()
        self.ends.append(time.perf_counter())

    @property
    def step_seconds(self) -> list[float]:
        return [end - begin for begin, end in zip(self.begins, self.ends)]
