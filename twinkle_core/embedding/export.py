"""Write a trained embedding model as a sentence-transformers directory.

    SentenceTransformer(path).encode(texts)   # the same embeddings as twinkle_core.embedding.embed_texts

The directory holds the (LoRA-merged) Hugging Face weights and tokenizer, modules.json (Transformer →
Pooling → Normalize), the pooling config, sentence_bert_config.json and config_sentence_transformers.json
with the query prompt and cosine similarity. Last-token models get a tokenizer that appends EOS itself, so
sentence-transformers feeds the model what it was trained on.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

from twinkle_core.atomic import atomic_dir

from .settings import EmbeddingSettings

logger = logging.getLogger(__name__)

_MODULES = [
    {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
    {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
]


def _pooling_config(dimension: int, pooling: str) -> dict:
    return {"word_embedding_dimension": dimension, "pooling_mode_cls_token": pooling == "cls",
            "pooling_mode_mean_tokens": pooling == "mean", "pooling_mode_max_tokens": False,
            "pooling_mode_mean_sqrt_len_tokens": False, "pooling_mode_weightedmean_tokens": False,
            "pooling_mode_lasttoken": pooling == "last", "include_prompt": True}


def _append_eos(tokenizer) -> None:
    """Make a fast tokenizer end every text with EOS (unless it already does), as the model was trained."""
    from tokenizers.processors import TemplateProcessing

    eos, eos_id = tokenizer.eos_token, tokenizer.eos_token_id
    probe = tokenizer("a", add_special_tokens=True)["input_ids"]
    if eos is None or (probe and probe[-1] == eos_id):
        return
    tokenizer.backend_tokenizer.post_processor = TemplateProcessing(
        single=f"$A {eos}", pair=f"$A {eos} $B {eos}", special_tokens=[(eos, eos_id)])


def load_embedding_weights(base_dir: Path, checkpoint: Path):
    """The trained encoder as one plain transformers model: a full checkpoint, or base + LoRA merged."""
    from transformers import AutoModel

    if not (checkpoint / "adapter_config.json").is_file():
        return AutoModel.from_pretrained(checkpoint, dtype="auto")
    from peft import PeftModel

    base = AutoModel.from_pretrained(base_dir, dtype="auto")
    return PeftModel.from_pretrained(base, checkpoint).merge_and_unload()


def write_sentence_transformer(base_dir: str | Path, checkpoint: str | Path, target: str | Path,
                               settings: EmbeddingSettings, max_seq_length: int) -> Path:
    """`target`: the sentence-transformers directory of `checkpoint` (an adapter on `base_dir`, or full)."""
    from transformers import AutoTokenizer

    base_dir, checkpoint, target = Path(base_dir), Path(checkpoint), Path(target)
    model = load_embedding_weights(base_dir, checkpoint)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    if settings.append_eos:
        _append_eos(tokenizer)
    with atomic_dir(target) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / "modules.json").write_text(json.dumps(_MODULES, indent=2))
        (tmp / "1_Pooling").mkdir()
        (tmp / "1_Pooling" / "config.json").write_text(
            json.dumps(_pooling_config(model.config.hidden_size, settings.pooling), indent=2))
        (tmp / "2_Normalize").mkdir()
        (tmp / "sentence_bert_config.json").write_text(
            json.dumps({"max_seq_length": max_seq_length, "do_lower_case": False}, indent=2))
        (tmp / "config_sentence_transformers.json").write_text(json.dumps({
            "model_type": "SentenceTransformer", "prompts": {"query": settings.query_prompt, "document": ""},
            "default_prompt_name": None, "similarity_fn_name": "cosine"}, indent=2))
    logger.info("wrote the sentence-transformers model %s", target)
    return target
