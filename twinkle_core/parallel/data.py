"""Each data-parallel rank's share of a global micro-batch, in the single-process order.

The loader walks the same seeded order as one process and cuts the same global micro-batches of
`batch_size` rows; rank r of N then takes rows r, r+N, r+2N, ... of each. Together the ranks train on
exactly the global batch one process would, so the token-normalised update is the same.
"""
from __future__ import annotations

import random
from typing import Iterator, Sequence

from twinkle_core.data.encode import IGNORE_INDEX


def local_rows(rows: list[dict], rank: int, world: int) -> list[dict]:
    """Rows `rank::world` of one global micro-batch.

    A rank left without rows (the last, short micro-batch of an epoch) gets one row with every label
    masked (rows without labels, e.g. embedding pairs, are marked `masked`): it still runs forward and
    backward, which FSDP's and DDP's collectives need from every rank, but it adds no trained token and no loss.
    """
    if not rows:
        raise ValueError("local_rows needs the rows of a non-empty global micro-batch.")
    if not 0 <= rank < world:
        raise ValueError(f"rank={rank} must be in 0 .. world-1 = {world - 1}.")
    share = rows[rank::world]
    if share:
        return share
    if "labels" not in rows[0]:
        return [{**rows[0], "masked": True}]
    return [{**rows[0], "labels": [IGNORE_INDEX] * len(rows[0]["labels"])}]



def local_micro_batches(examples: Sequence[dict], batch_size: int, seed: int, rank: int, world: int,
                        skip: int = 0, group_by_length: bool = False) -> Iterator[list[dict]]:
    """This rank's rows of every global micro-batch: a fresh seeded shuffle each epoch, forever.

    `batch_size` rows make one global micro-batch (the caller's step count ends the loop). The first `skip`
    micro-batches (trained on before a resume) are passed over. Only this rank's rows are read from `examples`
    (a lazily read TokenizedRows reads nothing else). `group_by_length`: each micro-batch holds rows of similar
    length (length_grouped_batches), from the lengths alone (TokenizedRows.lengths(): no row is read).
    """
    order_rng = random.Random(seed)
    lengths = _row_lengths(examples) if group_by_length else None
    while True:
        order = list(range(len(examples)))
        order_rng.shuffle(order)
        batches = length_grouped_batches(order, lengths, batch_size, order_rng) if group_by_length else \
            [order[start:start + batch_size] for start in range(0, len(order), batch_size)]
        for batch in batches:
            if skip > 0:
                skip -= 1
                continue
            share = batch[rank::world]
            # A rank left without rows gets local_rows' masked stand-in, built from the batch's first row.
            yield [examples[i] for i in share] if share else local_rows([examples[batch[0]]], rank, world)


GROUP_POOL = 64  # micro-batches whose rows are sorted by length together


def length_grouped_batches(order: list[int], lengths: Sequence[int], batch_size: int,
                           rng: random.Random) -> list[list[int]]:
    """Micro-batches of rows of similar length, in a seeded random order (HF Trainer's and ms-swift's scheme).

    The shuffled `order` is cut into pools of GROUP_POOL micro-batches; each pool is sorted by length (longest
    first, ties in shuffled order) and cut into micro-batches, and the micro-batches of the epoch are shuffled.
    Every row is still seen once per epoch, and the same seed gives the same batches (so a resume skips exactly
    the micro-batches already trained on). Only the last micro-batch of the epoch may be short."""
    pool = batch_size * GROUP_POOL
    sorted_rows = []
    for start in range(0, len(order), pool):
        sorted_rows += sorted(order[start:start + pool], key=lambda index: -int(lengths[index]))
    batches = [sorted_rows[start:start + batch_size] for start in range(0, len(sorted_rows), batch_size)]
    full = [batch for batch in batches if len(batch) == batch_size]
    rng.shuffle(full)
    return full + [batch for batch in batches if len(batch) < batch_size]


def _row_lengths(examples: Sequence[dict]) -> Sequence[int]:
    lengths = getattr(examples, "lengths", None)
    return lengths() if callable(lengths) else [len(example["input_ids"]) for example in examples]
