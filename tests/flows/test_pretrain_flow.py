"""The pretrain flow end to end on a tiny Llama: pack → convert → megatron training → HF export → evaluate → register."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from mlflow import MlflowClient

from flows.pretrain import PretrainConfig, pretrain
from tiny_models import make_tiny_tokenizer
from twinkle_core.data.pretrain import PackedSplit, pack_text_corpus

WORDS = "twinkle flows trains models on megatron core with tensor pipeline and data parallel layouts".split()


def write_corpus(path, documents: int = 40):
    lines = [json.dumps({"text": " ".join(WORDS[(i + j) % len(WORDS)] for j in range(6 + i % 5))})
             for i in range(documents)]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_pretrain_flow_trains_exports_evaluates_and_registers(sft_workspace):
    ws = sft_workspace
    config = PretrainConfig(model_id=str(ws["model"]), dataset=str(write_corpus(ws["root"] / "corpus.jsonl")),
                            seq_length=16, max_steps=6, global_batch_size=4, micro_batch_size=2, lr=1e-2,
                            mixed_precision="no", checkpoint_every=3, experiment_name="pretrain-test")
    result = pretrain(config)
    metrics = result["metrics"]
    assert metrics["eval_trained_loss"] < metrics["eval_base_loss"]  # the held-out loss fell
    # the exported HF model gives the Megatron model's validation loss: the conversion back is exact
    assert abs(result["report"]["loss"] - metrics["eval_trained_loss"]) <= 1e-4 * metrics["eval_trained_loss"]
    client = MlflowClient()
    losses = [m.value for m in sorted(client.get_metric_history(result["run_id"], "loss"), key=lambda m: m.step)]
    assert len(losses) == 6 and losses[-1] < losses[0]
    version = client.get_model_version(result["registration"]["name"], result["registration"]["version"])
    assert version.run_id == result["run_id"]
    assert "pre-training summary" in result["summary"]


def test_pretrain_flow_trains_on_a_blend_of_a_megatron_prefix_and_a_text_corpus(sft_workspace):
    """A Megatron-LM .bin/.idx corpus (written with megatron-core's builder) blended 3:1 with a .jsonl corpus."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
    from transformers import AutoTokenizer

    from twinkle_core.data.encode import encode_text

    ws = sft_workspace
    tokenizer = AutoTokenizer.from_pretrained(ws["model"])
    prefix = ws["root"] / "web_text_document"
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    for i in range(40):
        ids = encode_text(tokenizer, " ".join(WORDS[(3 * i + j) % len(WORDS)] for j in range(8 + i % 7)))["input_ids"]
        builder.add_document(ids, [len(ids)])
    builder.finalize(f"{prefix}.idx")
    text = write_corpus(ws["root"] / "corpus.jsonl")
    config = PretrainConfig(model_id=str(ws["model"]), dataset=f"0.75 {prefix} 0.25 {text}", seq_length=16,
                            max_steps=2, global_batch_size=4, micro_batch_size=2, lr=1e-2, mixed_precision="no",
                            eval_batches=2, experiment_name="pretrain-blend-test")
    result = pretrain(config)
    metrics = result["metrics"]
    assert np.isfinite(metrics["loss"]) and np.isfinite(metrics["eval_trained_loss"])
    assert np.isfinite(result["report"]["loss"])  # the exported model's validation loss, on the blend's split
    assert f"0.75 × `{prefix}`" in result["summary"] and f"0.25 × `{text}`" in result["summary"]


def test_bad_layouts_are_refused_before_anything_runs(tmp_path):
    with pytest.raises(ValueError, match="tp=2 x pp=1 does not divide the 1 processes"):
        PretrainConfig(model_id=str(tmp_path), tp_size=2)
    with pytest.raises(ValueError, match="global_batch_size=6 must be a multiple"):
        PretrainConfig(model_id=str(tmp_path), global_batch_size=6, micro_batch_size=4)
    with pytest.raises(ValueError, match="fp8"):
        PretrainConfig(model_id=str(tmp_path), mixed_precision="fp8")


def test_a_bad_corpus_is_refused_before_anything_runs(tmp_path):
    (tmp_path / "corpus.bin").write_bytes(b"")  # a Megatron prefix without its .idx
    with pytest.raises(ValueError, match=r"dataset='0.5 .*corpus 0.5 .*': dataset id '.*corpus': .*corpus\.idx not found"):
        PretrainConfig(model_id=str(tmp_path), dataset=f"0.5 {tmp_path / 'corpus'} 0.5 {tmp_path / 'corpus.bin'}")
    with pytest.raises(ValueError, match="a blend is weight, path pairs"):
        PretrainConfig(model_id=str(tmp_path), dataset="0.5 a.jsonl 0.5")


def test_packing_splits_documents_and_samples_resumably(tmp_path):
    tokenizer = make_tiny_tokenizer()
    out = pack_text_corpus(write_corpus(tmp_path / "c.jsonl"), tokenizer, 16, tmp_path / "packed",
                           validation_fraction=0.2, seed=1)
    meta = json.loads((out / "meta.json").read_text())
    assert meta["documents"]["train"] + meta["documents"]["validation"] == 40
    train = PackedSplit.open(out, "train")
    assert len(train) == meta["tokens"]["train"] // 16 == meta["sequences"]["train"]
    # step k always takes the same rows; consecutive steps of an epoch never repeat a sequence
    assert train.step_indices(3, 4, seed=7) == train.step_indices(3, 4, seed=7)
    epoch = [i for step in range(len(train) // 4) for i in train.step_indices(step, 4, seed=7)]
    assert len(set(epoch)) == len(epoch)
    index = next(i for i in range(len(train)) if len(set(train.document_ids(i)[1:])) > 1)  # a boundary inside
    docs = train.document_ids(index)
    first_boundary = int((docs != docs[0]).nonzero()[0][0])
    assert first_boundary >= 2
    mask = train.batch([index], document_masks=True)["attention_mask"][0, 0]
    assert mask[first_boundary, first_boundary - 1] < 0 and mask[first_boundary - 1, first_boundary - 2] == 0
    future = torch.ones(mask.shape, dtype=torch.bool).triu(1)
    assert (mask[future] < 0).all()  # causal


def test_sft_on_the_megatron_backend_trains_evaluates_and_registers_a_peft_adapter(sft_workspace):
    from flows.sft import SFTConfig, sft

    ws = sft_workspace
    config = SFTConfig(model_id=str(ws["model"]), dataset=str(ws["train"]), eval_dataset=str(ws["heldout"]),
                       backend="megatron", nproc_per_node=2, tp_size=2, mixed_precision="no", max_steps=4,
                       batch_size=4, gradient_accumulation_steps=2, lr=1e-2, max_length=64, eval_prompts=1,
                       max_new_tokens=4, registered_model_name="tiny-megatron-sft", checkpoint_every=2,
                       output_dir=str(ws["root"] / "runs"), timeout_minutes=10)
    result = sft(config)
    reports = result["reports"]
    assert reports["trained"]["eval_loss"] < reports["base"]["eval_loss"]
    assert (Path(result["checkpoint"]) / "adapter_config.json").is_file()  # a PEFT adapter of the HF model
    client = MlflowClient()
    assert len(client.get_metric_history(result["run_id"], "loss")) == 4


def test_megatron_sft_refuses_what_megatron_cannot_do(tmp_path):
    from flows.sft import SFTConfig

    with pytest.raises(ValueError, match="packing=True: packed samples restart"):
        SFTConfig(model_id=str(tmp_path), backend="megatron", packing=True)
    with pytest.raises(ValueError, match="sequence_parallel=True .* needs tp > 1"):
        SFTConfig(model_id=str(tmp_path), backend="megatron", sequence_parallel=True)
    with pytest.raises(ValueError, match="pp_size=2: pipeline parallelism arrives with the Megatron backend"):
        SFTConfig(model_id=str(tmp_path), nproc_per_node=2, pp_size=2)
