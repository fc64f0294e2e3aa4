"""The embedding flow end to end on a tiny BERT: tokenize → train (InfoNCE) → retrieval eval → register an
MLflow sentence_transformers model, with the LoRA adapter beside it."""
from __future__ import annotations

import mlflow.pyfunc
import mlflow.sentence_transformers
import numpy as np
import pytest
from mlflow import MlflowClient
from sentence_transformers import SentenceTransformer

from embedding_models import PAIRS, save_tiny_bert, write_pairs
from flows.embedding import EmbeddingConfig, embedding


def test_embedding_flow_trains_evaluates_and_registers_a_sentence_transformer(sft_workspace):
    ws = sft_workspace
    bert = save_tiny_bert(ws["root"] / "bert")
    pairs = write_pairs(ws["root"] / "pairs.jsonl", PAIRS * 3)
    config = EmbeddingConfig(model_id=str(bert), dataset=str(pairs), eval_dataset=str(pairs), max_steps=6,
                             batch_size=8, lr=1e-2, mixed_precision="no", experiment_name="embedding-test")
    result = embedding(config)
    base, trained = result["reports"]["base"], result["reports"]["trained"]
    assert trained["corpus"] == 18 and trained["queries"] == 9
    assert trained["mrr@10"] > base["mrr@10"]  # it learned the pairs it trained on
    assert f"base recall@1: {base['recall@1']:.4f}" in result["summary"]
    assert f"trained recall@1: {trained['recall@1']:.4f}" in result["summary"]
    client = MlflowClient()
    run = client.get_run(result["run_id"])
    assert run.data.metrics["eval_recall_at_1"] == pytest.approx(trained["recall@1"])
    assert len(client.get_metric_history(result["run_id"], "loss")) == 6
    version = client.get_model_version(result["registration"]["name"], result["registration"]["version"])
    assert version.run_id == result["run_id"]
    artifacts = {a.path for a in client.list_artifacts(result["run_id"])}
    assert {"model", "adapter"} <= artifacts
    # The version is an MLflow sentence_transformers model: its flavor and its pyfunc give the same vectors as the
    # export loaded by sentence-transformers itself.
    uri = f"models:/{version.name}/{version.version}"
    vectors = mlflow.sentence_transformers.load_model(uri).encode(["What do cats eat?"])
    assert vectors.shape == (1, 32)
    served = mlflow.pyfunc.load_model(uri).predict(["What do cats eat?"])
    direct = SentenceTransformer(result["checkpoint"], device="cpu").encode(["What do cats eat?"])
    assert np.allclose(served, direct, atol=1e-6) and np.allclose(vectors, direct, atol=1e-6)


def test_embedding_runs_refuse_model_parallel_layouts_and_sft_refuses_embedding_models(tmp_path):
    with pytest.raises(ValueError, match="tp_size=2: the infonce objective splits over dp, fsdp only"):
        EmbeddingConfig(model_id=str(tmp_path), nproc_per_node=2, tp_size=2)
    with pytest.raises(ValueError, match="backend='megatron': the infonce objective runs on transformers"):
        EmbeddingConfig(model_id=str(tmp_path), backend="megatron")
    from flows.sft import SFTConfig

    with pytest.raises(ValueError, match="is a Qwen3-Embedding embedding model; train it with python -m flows.embedding"):
        SFTConfig(model_id="hf://Qwen/Qwen3-Embedding-0.6B")
