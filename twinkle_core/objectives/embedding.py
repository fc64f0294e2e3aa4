"""The `infonce` objective: embedding models (Qwen3-Embedding, GTE/BERT encoders) on query/passage pairs.

Its model loads as `AutoModel` (no LM head), a LoRA adapter has PEFT's FEATURE_EXTRACTION task type, and
it splits over data-parallel ranks only (DDP or FSDP): the loss needs each text's whole sequence.
Options: temperature (0.1), pooling (the checkpoint's or the family's), same_side (query–query and
doc–doc negatives). The registered form is a sentence-transformers directory.
"""
from __future__ import annotations

import functools
from pathlib import Path

import torch

from twinkle_core.embedding.settings import EmbeddingSettings, resolve_settings
from twinkle_core.objectives import Objective, register_objective
from twinkle_core.objectives.infonce import embed_pairs, infonce_from_embeddings, infonce_loss_sum

DEFAULT_TEMPERATURE = 0.1  # as Twinkle and ms-swift
EXPORT_NAME = "sentence_transformer"  # the registered folder beside the checkpoint


def _options(model_dir: Path, family, options: dict) -> dict:
    """Completed options; `query_prompt` (already on the tokenised queries) is kept for the export."""
    settings = resolve_settings(model_dir, family, options.get("pooling"), options.get("query_task"))
    if "query_prompt" in options:
        settings = EmbeddingSettings(settings.pooling, options["query_prompt"])
    temperature = float(options.get("temperature", DEFAULT_TEMPERATURE))
    if temperature <= 0:
        raise ValueError(f"temperature={temperature!r} must be > 0 (scores are q·d / temperature)")
    return {"temperature": temperature, "pooling": settings.pooling, "same_side": bool(options.get("same_side")),
            "query_prompt": settings.query_prompt}


def _encode_options(options: dict) -> dict:
    return EmbeddingSettings(options["pooling"], options["query_prompt"]).encode_options()


def _freeze_unused_heads(model: torch.nn.Module) -> None:
    """BERT's pooler (tanh over CLS, for next-sentence prediction) is not part of a sentence embedding: frozen,
    it gets no gradient that DDP would wait for."""
    pooler = getattr(model, "pooler", None)
    if isinstance(pooler, torch.nn.Module):
        pooler.requires_grad_(False)


def _export(model, saved: Path, output_dir: Path) -> Path:
    """The sentence-transformers directory of what `model` saved (rank 0 writes it; every rank waits)."""
    from twinkle_core.embedding.export import write_sentence_transformer
    from twinkle_core.parallel import is_main_process
    from twinkle_core.parallel.process_group import barrier

    target = Path(output_dir) / EXPORT_NAME
    if is_main_process():
        options = model.objective_options
        settings = EmbeddingSettings(options["pooling"], options["query_prompt"])
        write_sentence_transformer(model.hf_dir, saved, target, settings, model.max_length or 512)
    if model.parallel.is_distributed:
        barrier()
    return target


def register_infonce(name: str, **loss_options) -> Objective:
    """Register an InfoNCE objective (`loss_options` fixed for it, e.g. a gather in tests)."""
    loss_sum = functools.partial(infonce_loss_sum, **loss_options)
    from_embeddings = functools.partial(infonce_from_embeddings, **loss_options)
    return register_objective(Objective(
        name, "pairs", loss_sum, frozenset({"transformers"}), auto_class="AutoModel",
        peft_task_type="FEATURE_EXTRACTION", splits=frozenset({"dp", "fsdp"}), resolve_options=_options,
        prepare_model=_freeze_unused_heads, export=_export, encode_options=_encode_options,
        option_names=("temperature", "pooling", "same_side", "query_task", "query_prompt"), embeds=True,
        embed=embed_pairs, loss_from_embeddings=from_embeddings))


register_infonce("infonce")
