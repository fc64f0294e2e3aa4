"""Retrieval evaluation of embedding models: held-out queries against the held-out corpus.

    python -m twinkle_core.evaluate.retrieval EVAL_CONFIG.json   (writes the result JSON named in the config)

The corpus is every distinct positive and hard negative of the held-out rows; a query's relevant passages
are its positives (rows with the same query text pool theirs). Each model (the base, the trained
sentence-transformers directory) embeds the queries (with the query prompt) and the corpus, ranks the corpus
by cosine similarity and reports recall@1, recall@10, MRR@10 and nDCG@10 (binary relevance).
"""
from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import torch
from pydantic import BaseModel, Field

from twinkle_core.data import load_rows
from twinkle_core.data.pairs import encode_text_ids
from twinkle_core.embedding.settings import EmbeddingSettings
from twinkle_core.entry import finish_worker, worker_config_path
from twinkle_core.objectives.infonce import embed

logger = logging.getLogger(__name__)
METRICS = ("recall@1", "recall@10", "mrr@10", "ndcg@10")


class RetrievalEvalConfig(BaseModel):
    models: dict[str, Path] = Field(description="label -> a model directory (base, or the trained export)")
    heldout_data: Path  # the held-out .jsonl of embedding rows
    pooling: str
    query_prompt: str = ""
    max_length: int = 256
    batch_size: int = 32
    max_bad_fraction: float = 0.01
    result_path: Path


def retrieval_task(rows: list[dict]) -> tuple[list[str], list[str], list[set[int]]]:
    """(queries, corpus, relevant corpus indices of each query) from validated embedding rows."""
    corpus: dict[str, int] = {}
    relevant: dict[str, set[int]] = {}
    for row in rows:
        for text in row["positives"] + row["negatives"]:
            corpus.setdefault(text, len(corpus))
        relevant.setdefault(row["query"], set()).update(corpus[text] for text in row["positives"])
    return list(relevant), list(corpus), list(relevant.values())


def ranking_metrics(scores: torch.Tensor, relevant: list[set[int]], k: int = 10) -> dict[str, float]:
    """recall@1, recall@k, MRR@k and nDCG@k of (queries × corpus) `scores`, averaged over the queries."""
    top = scores.topk(min(k, scores.shape[1]), dim=1).indices.tolist()
    totals = dict.fromkeys(METRICS, 0.0)
    for ranked, wanted in zip(top, relevant):
        hits = [doc in wanted for doc in ranked]
        totals["recall@1"] += float(hits[0])
        totals["recall@10"] += float(any(hits))
        first = next((i for i, hit in enumerate(hits) if hit), None)
        totals["mrr@10"] += 0.0 if first is None else 1.0 / (first + 1)
        dcg = sum(1.0 / math.log2(i + 2) for i, hit in enumerate(hits) if hit)
        ideal = sum(1.0 / math.log2(i + 2) for i in range(min(len(wanted), len(ranked))))
        totals["ndcg@10"] += dcg / ideal
    return {name: value / len(relevant) for name, value in totals.items()}


@torch.no_grad()
def embed_texts(model, tokenizer, texts: list[str], settings: EmbeddingSettings, prompt: str = "",
                max_length: int = 256, batch_size: int = 32) -> torch.Tensor:
    """L2-normalised embeddings of `texts` (each prefixed with `prompt`), as training computes them."""
    from twinkle_core.data.pairs import collate_pairs

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    out = []
    for start in range(0, len(texts), batch_size):
        ids = [encode_text_ids(tokenizer, prompt + text, settings.append_eos)[:max_length]
               for text in texts[start:start + batch_size]]
        batch = collate_pairs([{"query_ids": i, "positive_ids": i, "negative_ids": []} for i in ids], pad)
        out.append(embed(model, batch["query_input_ids"], batch["query_attention_mask"], settings.pooling))
    return torch.cat(out)


def evaluate_model(model_dir: Path, config: RetrievalEvalConfig, queries: list[str], corpus: list[str],
                   relevant: list[set[int]]) -> dict[str, float]:
    from transformers import AutoModel, AutoTokenizer

    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    settings = EmbeddingSettings(config.pooling, config.query_prompt)
    args = dict(max_length=config.max_length, batch_size=config.batch_size)
    query_vectors = embed_texts(model, tokenizer, queries, settings, settings.query_prompt, **args)
    corpus_vectors = embed_texts(model, tokenizer, corpus, settings, **args)
    return ranking_metrics(query_vectors @ corpus_vectors.T, relevant)


def run(config: RetrievalEvalConfig) -> dict[str, dict[str, float]]:
    rows = load_rows(config.heldout_data, "pairs", config.max_bad_fraction).rows
    queries, corpus, relevant = retrieval_task(rows)
    reports = {}
    for label, model_dir in config.models.items():
        reports[label] = {**evaluate_model(model_dir, config, queries, corpus, relevant),
                          "queries": len(queries), "corpus": len(corpus)}
        logger.info("%s: %s", label, ", ".join(f"{k} {v:.4f}" for k, v in reports[label].items()))
    return reports


def main(argv: list[str] | None = None) -> int:
    path = worker_config_path(argv, "python -m twinkle_core.evaluate.retrieval EVAL_CONFIG.json")
    config = RetrievalEvalConfig.model_validate_json(Path(path).read_text())
    reports = run(config)
    config.result_path.write_text(json.dumps(reports, indent=2))
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    finish_worker(main())
