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
                        skip: int = 0) -> Iterator[list[dict]]:
    """This rank's rows of every global micro-batch: a fresh seeded shuffle each epoch, forever.

    `batch_size` rows make one global micro-batch (the caller's step count ends the loop). The first `skip`
    micro-batches (trained on before a resume) are passed over. Only this rank's rows are read from `examples`
    (a lazily read TokenizedRows reads nothing else).
    """
    order_rng = random.Random(seed)
    while True:
        order = list(range(len(examples)))
        order_rng.shuffle(order)
        for start in range(0, len(order), batch_size):
            if skip > 0:
                skip -= 1
                continue
            batch = order[start:start + batch_size]
            share = batch[rank::world]
            # A rank left without rows gets local_rows' masked stand-in, built from the batch's first row.
            yield [examples[i] for i in share] if share else local_rows([examples[batch[0]]], rank, world)
