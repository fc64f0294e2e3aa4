"""pack: tokenise a {"text": ...} corpus into packed, memory-mapped sequences (cached by content)."""
from __future__ import annotations

import json
from pathlib import Path

from prefect import get_run_logger, task
from prefect.cache_policies import INPUTS, TASK_SOURCE
from transformers import AutoTokenizer

from tasks.refs import DatasetRef, ModelRef, PackedRef
from twinkle_core.convert.megatron_checkpoint import HF_DIR, is_megatron_checkpoint
from twinkle_core.data.pretrain import pack_text_corpus
from twinkle_core.hashing import hash_json
from twinkle_core.paths import cache_root


@task(cache_policy=INPUTS + TASK_SOURCE, persist_result=True, result_serializer="json")
def pack(dataset: DatasetRef, model: ModelRef, seq_length: int, validation_fraction: float, seed: int,
         max_bad_fraction: float = 0.01) -> PackedRef:
    """Pack `dataset` with `model`'s tokenizer into train/validation sequences of `seq_length` tokens."""
    tokenizer_dir = Path(model.path) / HF_DIR if is_megatron_checkpoint(model.path) else model.path
    key = hash_json({"data": dataset.content_hash, "model": model.content_hash, "seq_length": seq_length,
                     "validation_fraction": validation_fraction, "seed": seed})
    out = pack_text_corpus(dataset.path, AutoTokenizer.from_pretrained(tokenizer_dir), seq_length,
                           cache_root() / "packed" / key, validation_fraction, seed, max_bad_fraction)
    meta = json.loads((out / "meta.json").read_text())
    get_run_logger().info("%s: %s documents, %s tokens, %s sequences of %d tokens (train / validation)",
                          dataset.dataset_id, meta["documents"], meta["tokens"], meta["sequences"], seq_length)
    return PackedRef(path=str(out), content_hash=key, train_sequences=meta["sequences"]["train"],
                     validation_sequences=meta["sequences"]["validation"], train_tokens=meta["tokens"]["train"])
