"""The InfoNCE objective on tiny BERT and Qwen3 models: pooling by hand, the loss against sentence-transformers,
false-negative masking, the sentence-transformers export, and the pairs row kind's bad rows."""
from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from sentence_transformers import SentenceTransformer
from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss
from transformers import AutoModel, AutoTokenizer

from embedding_models import PAIRS, save_tiny_bert, save_tiny_gte, save_tiny_qwen3, write_pairs
from twinkle_core.data import DatasetError, load_tokenized, tokenize_dataset
from twinkle_core.data.pairs import collate_pairs, encode_pair_row, encode_text_ids, validate_pair_row
from twinkle_core.embedding.settings import resolve_settings
from twinkle_core.evaluate.retrieval import embed_texts, ranking_metrics
from twinkle_core.families import get_family
from twinkle_core.models import TransformersModel
from twinkle_core.objectives.infonce import embed, infonce_loss_sum, pool


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    return save_tiny_bert(tmp_path_factory.mktemp("bert") / "bert")


def _batch(tokenizer, rows, **options):
    examples = [e for row in rows for e in encode_pair_row(tokenizer, validate_pair_row(row), **options)]
    return collate_pairs(examples, tokenizer.pad_token_id)


def test_pooling_matches_a_hand_computation():
    hidden = torch.randn(2, 4, 3)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    torch.testing.assert_close(pool(hidden, mask, "mean"), torch.stack([hidden[0, :3].mean(0), hidden[1, :2].mean(0)]))
    torch.testing.assert_close(pool(hidden, mask, "cls"), hidden[:, 0])
    torch.testing.assert_close(pool(hidden, mask, "last"), torch.stack([hidden[0, 2], hidden[1, 1]]))
    with pytest.raises(ValueError, match="pooling='max': choose one of mean, cls, last"):
        pool(hidden, mask, "max")


@pytest.mark.parametrize("same_side", [False, True])
def test_loss_equals_sentence_transformers_multiple_negatives_ranking_loss(bert, same_side):
    rows = [dict(row, negatives=row["negatives"][:1]) for row in PAIRS if row["negatives"]]  # one column each
    st = SentenceTransformer(str(bert), device="cpu")
    directions = ("query_to_doc", "query_to_query", "doc_to_doc") if same_side else ("query_to_doc",)
    reference = MultipleNegativesRankingLoss(st, scale=1 / 0.1, directions=directions)
    columns = [[row["query"] for row in rows], [row["positive"] for row in rows], [row["negatives"][0] for row in rows]]
    want = reference([st.tokenize(texts) for texts in columns], None)
    model = AutoModel.from_pretrained(bert, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(bert)
    parts = infonce_loss_sum(model, _batch(tokenizer, rows), temperature=0.1, pooling="mean", same_side=same_side)
    assert parts.num_tokens == len(rows)
    assert abs(float(parts.loss_sum.detach()) / parts.num_tokens - float(want.detach())) <= 1e-6


def test_identical_texts_are_masked_as_false_negatives(bert):
    model = AutoModel.from_pretrained(bert, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(bert)
    rows = [{"query": "red fruit", "positive": "An apple is red.", "negatives": ["A banana is yellow."]},
            {"query": "a fruit", "positive": "An apple is red.", "negatives": []},  # the same positive text
            {"query": "red fruit", "positive": "A cherry is red.", "negatives": []}]  # the same query text
    parts = infonce_loss_sum(model, _batch(tokenizer, rows), temperature=0.1, pooling="mean")
    docs = ["An apple is red.", "An apple is red.", "A cherry is red.", "A banana is yellow."]
    q = embed_texts(model, tokenizer, [row["query"] for row in rows], resolve_settings(bert, get_family("bert_embedding")))
    d = embed_texts(model, tokenizer, docs, resolve_settings(bert, get_family("bert_embedding")))
    # row: (its positive, the docs it must not see): 0 and 1 share a text; 0 and 2 share a query
    keep = {0: (0, [0, 3]), 1: (1, [1, 2, 3]), 2: (2, [2, 3])}
    want = sum(-F.log_softmax(q[i] @ d[cands].T / 0.1, dim=0)[cands.index(pos)] for i, (pos, cands) in keep.items())
    assert abs(float(parts.loss_sum) - float(want)) <= 1e-5


def test_qwen3_embedding_reads_the_last_token_with_the_query_instruction(tmp_path):
    qwen = save_tiny_qwen3(tmp_path / "qwen3")
    model = TransformersModel(str(qwen), objective="infonce", family="qwen3_embedding", mixed_precision="no")
    options = model.objective_options
    assert options["pooling"] == "last"
    assert options["query_prompt"] == ("Instruct: Given a web search query, retrieve relevant passages that answer "
                                       "the query\nQuery:")
    tokenizer = model.tokenizer
    ids = encode_text_ids(tokenizer, "hello world", append_eos=True)
    assert ids[-1] == tokenizer.eos_token_id
    example = encode_pair_row(tokenizer, validate_pair_row(PAIRS[2]), query_prompt=options["query_prompt"],
                              append_eos=True)[0]
    assert example["query_ids"] == encode_text_ids(tokenizer, options["query_prompt"] + PAIRS[2]["query"], True)
    # the embedding is the normalised hidden state at EOS, whatever the padding after it
    batch = collate_pairs([example, {**example, "query_ids": ids}], tokenizer.pad_token_id)
    with torch.no_grad():
        hidden = model.model(input_ids=torch.tensor([ids])).last_hidden_state[0, -1]
        got = embed(model.model, batch["query_input_ids"], batch["query_attention_mask"], "last")[1]
    torch.testing.assert_close(got, F.normalize(hidden, dim=-1), rtol=1e-5, atol=1e-6)
    # trained with LoRA, exported: sentence-transformers embeds exactly as we do (EOS appended by its tokenizer)
    model.add_adapter_to_model("default", model_lora())
    model.set_optimizer("AdamW", lr=1e-2)
    for _ in range(2):
        model.forward_backward(PAIRS[:4])
        model.clip_grad_and_step()
    exported = model.export("default", tmp_path / "out")
    _assert_same_embeddings(model, exported, prompt=options["query_prompt"])


@pytest.mark.parametrize("kind", ["bert", "gte"])
def test_lora_export_is_a_merged_sentence_transformer_with_the_adapter_beside_it(bert, tmp_path, kind):
    path = bert if kind == "bert" else save_tiny_gte(tmp_path / "gte")
    model = TransformersModel(str(path), objective="infonce", mixed_precision="no")
    # BERT: the checkpoint's pooling config; GTE: the family's CLS
    assert (model.family.name, model.objective_options["pooling"]) == (
        ("bert_embedding", "mean") if kind == "bert" else ("gte", "cls"))
    model.add_adapter_to_model("default", model_lora())
    assert not any("pooler" in name for name, p in model.model.named_parameters() if p.requires_grad)
    model.set_optimizer("AdamW", lr=1e-2)
    losses = []
    for _ in range(4):
        losses.append(model.forward_backward(PAIRS[:4]))
        model.clip_grad_and_step()
    assert losses[-1] < losses[0]
    exported = model.export("default", tmp_path / "out")
    assert (tmp_path / "out" / "default" / "adapter_config.json").is_file()
    assert not (exported / "adapter_config.json").exists()  # merged
    pooling = json.loads((exported / "1_Pooling" / "config.json").read_text())
    assert pooling["pooling_mode_mean_tokens" if kind == "bert" else "pooling_mode_cls_token"]
    _assert_same_embeddings(model, exported)


def model_lora():
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")


def _assert_same_embeddings(model: TransformersModel, exported, prompt: str = ""):
    texts = ["Where is the Eiffel Tower?", "A spider has eight legs and spins webs of silk."]
    settings = resolve_settings(exported, model.family)
    model.model.eval()
    ours = embed_texts(model.model, model.tokenizer, texts, settings, prompt)
    st = SentenceTransformer(str(exported), device="cpu")
    theirs = st.encode(texts, prompt=prompt, convert_to_tensor=True)
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-5)


def test_pair_layouts_bad_rows_and_the_cache(bert, tmp_path):
    rows = [
        PAIRS[0],
        {"anchor": "What do dogs eat?", "positive": "Dogs eat meat.", "negative": "Cows eat grass."},
        {"messages": [{"role": "user", "content": "How far is the moon?"}],
         "positive_messages": [[{"role": "assistant", "content": "About 384000 km."}]],
         "negative_messages": [[{"role": "assistant", "content": "The sun is far."}]]},
        {"query": "Two answers?", "positive": ["One.", "Two."]},
        {"query": "no positive"},
        {"query": "same", "positive": "Same text.", "negatives": ["Same text."]},
        {"query": "number", "positive": 5},
    ]
    path = write_pairs(tmp_path / "pairs.jsonl", rows)
    tokenized = tokenize_dataset(path, bert, kind="pairs", max_length=32, max_bad_fraction=0.5)
    assert [bad.line for bad in tokenized.bad] == [5, 6, 7]
    assert "positive is missing" in tokenized.bad[0].reason
    assert "identical to a positive" in tokenized.bad[1].reason
    assert tokenized.num_examples == 5  # the two-positive row gives one example per positive
    examples = load_tokenized(tokenized)
    assert [len(e["negative_ids"]) for e in examples] == [2, 1, 1, 0, 0]
    assert examples[3]["query_ids"] == examples[4]["query_ids"]
    with pytest.raises(DatasetError, match=r"pairs.jsonl:5: positive is missing"):
        tokenize_dataset(path, bert, kind="pairs", max_length=32, max_bad_fraction=0.1)


def test_ranking_metrics_by_hand():
    scores = torch.tensor([[0.9, 0.1, 0.5], [0.2, 0.3, 0.8]])
    metrics = ranking_metrics(scores, [{0}, {1}])  # query 0 ranks its passage first, query 1 second
    assert metrics["recall@1"] == 0.5 and metrics["recall@10"] == 1.0
    assert metrics["mrr@10"] == pytest.approx((1 + 1 / 2) / 2)
    assert metrics["ndcg@10"] == pytest.approx((1 + 1 / math.log2(3)) / 2)


def test_accumulation_through_cached_embeddings_equals_one_large_batch(bert):
    """2 micro-batches of 2 rows, accumulated with cached embeddings, update exactly as one batch of 4: each
    query also meets the other micro-batch's documents (plain accumulation would not)."""
    tokenizer = AutoTokenizer.from_pretrained(bert)
    rows = [PAIRS[i] for i in (0, 1, 3, 4)]
    results = {}
    halves = [_batch(tokenizer, rows[:2]), _batch(tokenizer, rows[2:])]
    for name, calls, steps in [("one batch", [_batch(tokenizer, rows)], 1), ("cached", [halves], 2),
                               ("plain", halves, 2)]:
        model = TransformersModel(str(bert), objective="infonce", mixed_precision="no")
        model.set_optimizer("SGD", lr=0.5, gradient_accumulation_steps=steps)
        for inputs in calls:
            loss = model.forward_backward(inputs)
        assert model.clip_grad_and_step(max_grad_norm=None)
        results[name] = loss, {n: p.detach().clone() for n, p in model.model.named_parameters() if p.requires_grad}
    (loss, weights), (cached_loss, cached_weights) = results["one batch"], results["cached"]
    assert abs(cached_loss - loss) <= 1e-6 * loss
    for name, weight in weights.items():  # fp32 noise only (sums in another order)
        torch.testing.assert_close(cached_weights[name], weight, rtol=1e-5, atol=1e-6)
    plain = results["plain"][1]  # micro-batches as separate pools of negatives: another update
    assert max(float((plain[n] - w).abs().max()) for n, w in weights.items()) > 1e-3
