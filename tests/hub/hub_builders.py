"""Build real on-disk fixtures for the hub tests: hub cache layouts, a fake package, a tiny GGUF."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import numpy as np


def populate_hf_cache(cache: Path, repo_id: str, source: Path, repo_type: str = "model",
                      commit: str = "a" * 40) -> Path:
    """Lay `source` out as huggingface_hub does: blobs by hash, snapshots/<commit> of symlinks, refs/main."""
    repo = cache / f"{repo_type}s--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    for path in sorted(p for p in source.rglob("*") if p.is_file()):
        data = path.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snapshot / path.relative_to(source)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    return snapshot


def populate_ms_cache(cache: Path, repo_id: str, source: Path, repo_type: str = "model",
                      revision: str = "master") -> Path:
    """Lay `source` out as modelscope 1.40 does: <cache>/<type>s/<org>--<name>/snapshots/<revision>/."""
    snapshot = cache / f"{repo_type}s" / repo_id.replace("/", "--") / "snapshots" / revision
    shutil.copytree(source, snapshot)
    return snapshot


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def make_package(root: Path, name: str) -> Path:
    """A package folder whose __init__ raises: the resolver must find files in it without importing it."""
    package = root / name
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("raise RuntimeError('this package must never be imported')\n")
    return package


def write_tiny_gguf(path: Path, model, tokenizer) -> Path:
    """Write a tiny Llama model and its byte-level BPE tokenizer as an F32 GGUF that transformers loads."""
    import gguf

    cfg = model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_vocab_size(cfg.vocab_size)
    _add_tokenizer(writer, tokenizer)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, cfg.num_hidden_layers)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight":  # tied to the embeddings; GGUF stores it once
            continue
        array = tensor.detach().float().numpy()
        # llama.cpp stores q/k rows permuted for its rotary layout; transformers undoes this on load.
        if name.endswith("q_proj.weight"):
            array = _permute(array, cfg.num_attention_heads)
        if name.endswith("k_proj.weight"):
            array = _permute(array, cfg.num_key_value_heads)
        writer.add_tensor(names.get_name(name, try_suffixes=(".weight", ".bias")), np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add_tokenizer(writer, tokenizer) -> None:
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    vocab = spec["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    special = {added["content"] for added in spec["added_tokens"]}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if token in special else 1 for token in tokens])  # 3 = CONTROL, 1 = NORMAL
    writer.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in spec["model"]["merges"]])
    writer.add_bos_token_id(tokenizer.bos_token_id)
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_pad_token_id(tokenizer.pad_token_id)
    writer.add_chat_template(tokenizer.chat_template)


def _permute(array: np.ndarray, heads: int) -> np.ndarray:
    return array.reshape(heads, 2, array.shape[0] // heads // 2, *array.shape[1:]).swapaxes(1, 2).reshape(array.shape)
