"""Each data-parallel rank's share of a global micro-batch, in the single-process order.

The loader walks the same seeded order as one process and cuts the same global micro-batches of
`batch_size` rows; rank r of N then takes rows r, r+N, r+2N, ... of each. Together the ranks train on
exactly the global batch one process would, so the token-normalised update is the same.
"""
from __future__ import annotations

from twinkle_core.data.encode import IGNORE_INDEX


def local_rows(rows: list[dict], rank: int, world: int) -> list[dict]:
    """Rows `rank::world` of one global micro-batch.

    A rank left without rows (the last, short micro-batch of an epoch) gets one row with every label
    masked: it still runs forward and backward, which FSDP's and DDP's collectives need from every rank,
    but it adds no trained token and no loss.
    """
    if not rows:
        raise ValueError("local_rows needs the rows of a non-empty global micro-batch.")
    if not 0 <= rank < world:
        raise ValueError(f"rank={rank} must be in 0 .. world-1 = {world - 1}.")
    share = rows[rank::world]
    if share:
        return share
    return [{**rows[0], "labels": [IGNORE_INDEX] * len(rows[0]["labels"])}]
