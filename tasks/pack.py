"""pack: tokenise a {"text": ...} corpus (or split a Megatron-LM .bin/.idx corpus) into packed, memory-mapped
sequences; blend: a weighted blend of packed corpora. Both cached by content."""
from __future__ import annotations

import json
from pathlib import Path

from prefect import get_run_logger, task
from prefect.cache_policies import INPUTS, TASK_SOURCE
from transformers import AutoConfig, AutoTokenizer

from tasks.refs import BlendPart, DatasetRef, ModelRef, PackedRef
from twinkle_core.convert.megatron_checkpoint import HF_DIR, is_megatron_checkpoint
from twinkle_core.data.blend import write_blend
from twinkle_core.data.pretrain import is_indexed_prefix, pack_text_corpus, split_indexed_corpus
from twinkle_core.hashing import hash_json
from twinkle_core.paths import cache_root


# num_proc is left out of the key: the packed corpus does not depend on it
@task(cache_policy=(INPUTS - "num_proc") + TASK_SOURCE, persist_result=True, result_serializer="json")
def pack(dataset: DatasetRef, model: ModelRef, seq_length: int, validation_fraction: float, seed: int,
         max_bad_fraction: float = 0.01, num_proc: int | None = None) -> PackedRef:
    """Pack `dataset` with `model`'s tokenizer into train/validation sequences of `seq_length` tokens, in
    `num_proc` tokenizer processes (default: the machine's cores, at most 8)."""
    model_dir = Path(model.path) / HF_DIR if is_megatron_checkpoint(model.path) else Path(model.path)
    key = hash_json({"data": dataset.content_hash, "model": model.content_hash, "seq_length": seq_length,
                     "validation_fraction": validation_fraction, "seed": seed})
    out = cache_root() / "packed" / key
    if is_indexed_prefix(dataset.path):  # already tokenised: split it, checked against the model's vocabulary
        config = AutoConfig.from_pretrained(model_dir, trust_remote_code=model.trust_remote_code)
        split_indexed_corpus(dataset.path, seq_length, out, config.get_text_config().vocab_size,
                             validation_fraction, seed)
    else:
        pack_text_corpus(dataset.path, AutoTokenizer.from_pretrained(model_dir), seq_length, out,
                         validation_fraction, seed, max_bad_fraction, num_proc)
    meta = json.loads((out / "meta.json").read_text())
    get_run_logger().info("%s: %s documents, %s tokens, %s sequences of %d tokens (train / validation)",
                          dataset.dataset_id, meta["documents"], meta["tokens"], meta["sequences"], seq_length)
    return PackedRef(path=str(out), content_hash=key, train_sequences=meta["sequences"]["train"],
                     validation_sequences=meta["sequences"]["validation"], train_tokens=meta["tokens"]["train"])


@task(cache_policy=INPUTS + TASK_SOURCE, persist_result=True, result_serializer="json")
def blend(corpora: list[PackedRef], weights: list[float], dataset_ids: list[str]) -> PackedRef:
    """The weighted blend of packed corpora (Megatron-LM's "0.7 A 0.3 B"); its validation split blends theirs."""
    key = hash_json({"corpora": [c.content_hash for c in corpora], "weights": weights})
    meta = write_blend([c.path for c in corpora], weights, dataset_ids, cache_root() / "blends" / key)
    parts = [BlendPart(dataset_id=p["dataset"], weight=p["weight"], train_sequences=p["sequences"]["train"],
                       validation_sequences=p["sequences"]["validation"]) for p in meta["blend"]]
    get_run_logger().info("blend of %d corpora: %s", len(parts),
                          ", ".join(f"{p.weight:.3g} × {p.dataset_id} ({p.train_sequences} sequences)" for p in parts))
    return PackedRef(path=str(cache_root() / "blends" / key), content_hash=key, blend=parts,
                     train_sequences=meta["sequences"]["train"], validation_sequences=meta["sequences"]["validation"],
                     train_tokens=meta["tokens"]["train"])
