"""Pre-training corpora in megatron-core's indexed format: written by pack_text_corpus, read from a
Megatron-LM .bin/.idx prefix, and blended by weight (twinkle_core.data.pretrain, twinkle_core.data.blend)."""
from __future__ import annotations

import json

import numpy as np
import pytest
from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder

from tasks.download import download_corpus
from twinkle_core.data.blend import BlendedSplit, parse_data_path, write_blend
from twinkle_core.data.encode import encode_text
from twinkle_core.data.errors import DatasetError
from twinkle_core.data.pretrain import PackedSplit, _is_validation, open_split, pack_text_corpus, split_indexed_corpus
from twinkle_core.hub import HubError

WORDS = "twinkle flows trains models on megatron core with tensor pipeline and data parallel layouts".split()
VOCAB = 384  # make_tiny_tokenizer's


def write_megatron_corpus(prefix, documents: list[np.ndarray], dtype=np.uint16):
    """A corpus as Megatron-LM's preprocess_data.py writes it: one sequence per document."""
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype)
    for document in documents:
        builder.add_document(document, [document.size])
    builder.finalize(f"{prefix}.idx")
    return prefix


def random_documents(count: int, seed: int, high: int = VOCAB) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, high, size=int(rng.integers(3, 30))) for _ in range(count)]


def expected_splits(documents, seed, fraction) -> dict[str, list[int]]:
    """Today's split rule, spelled out: the seeded hash per document, at least one document each side."""
    held = [i for i in range(len(documents)) if _is_validation(i, seed, fraction)]
    if not held or len(held) == len(documents):
        held = [len(documents) - 1]
    return {"train": [i for i in range(len(documents)) if i not in held], "validation": held}


def test_a_megatron_corpus_reads_back_as_the_tokens_written(tmp_path):
    documents = random_documents(60, seed=0)
    prefix = write_megatron_corpus(tmp_path / "web_text_document", documents)
    out = split_indexed_corpus(prefix, 16, tmp_path / "packed", VOCAB, validation_fraction=0.2, seed=3)
    assert not list(out.glob("*.bin"))  # the source .bin is read in place, not copied
    for split, picked in expected_splits(documents, 3, 0.2).items():
        stream = np.concatenate([documents[i] for i in picked])
        opened = open_split(out, split)
        assert len(opened) == stream.size // 16
        for i in range(len(opened)):
            assert opened.sequence(i).tolist() == stream[i * 16:(i + 1) * 16].tolist()
        starts = np.cumsum([0] + [documents[i].size for i in picked[:-1]])  # document ids change at the starts
        for i in range(len(opened)):
            ids = opened.document_ids(i)
            assert (np.diff(ids) > 0).tolist() == np.isin(i * 16 + np.arange(1, 16), starts).tolist()


def write_text_corpus(path, documents: int = 40, bad_line: int | None = None):
    lines = [json.dumps({"text": " ".join(WORDS[(i + j) % len(WORDS)] for j in range(6 + i % 5))})
             for i in range(documents)]
    if bad_line is not None:
        lines.insert(bad_line - 1, '{"text": "unterminated')
    path.write_text("\n".join(lines) + "\n")
    return path, [json.loads(line)["text"] for line in lines if line.endswith("}")]


def test_pack_text_corpus_writes_megatron_indexed_datasets_independent_of_num_proc(tmp_path, tokenizer):
    path, texts = write_text_corpus(tmp_path / "c.jsonl", bad_line=5)
    outs = [pack_text_corpus(path, tokenizer, 16, tmp_path / f"packed-{n}", 0.2, seed=1, max_bad_fraction=0.05,
                             num_proc=n, chunk_rows=3) for n in (1, 2)]  # 14 chunks: both workers encode
    for split, picked in expected_splits(texts, 1, 0.2).items():
        dataset = IndexedDataset(str(outs[0] / split), mmap=True)
        assert dataset.index.dtype == np.uint16  # a vocabulary under 65500 ids, as preprocess_data.py picks
        assert [dataset[i].tolist() for i in range(len(dataset))] == \
            [encode_text(tokenizer, texts[i])["input_ids"] for i in picked]
        for suffix in (".bin", ".idx"):
            assert (outs[0] / f"{split}{suffix}").read_bytes() == (outs[1] / f"{split}{suffix}").read_bytes()
    meta = json.loads((outs[0] / "meta.json").read_text())
    assert meta["documents"] == {split: len(picked) for split, picked in expected_splits(texts, 1, 0.2).items()}
    assert len(PackedSplit.open(outs[0], "train")) == meta["sequences"]["train"] == meta["tokens"]["train"] // 16
    with pytest.raises(DatasetError, match=r"(?s)1 of 41 rows are bad.*c\.jsonl:5: invalid JSON.*raise max_bad_fraction"):
        pack_text_corpus(path, tokenizer, 16, tmp_path / "strict", max_bad_fraction=0.0, num_proc=2, chunk_rows=3)


def test_a_blend_draws_rows_by_weight_and_resumes(tmp_path):
    prefixes = [write_megatron_corpus(tmp_path / name, random_documents(80, seed)) for seed, name in enumerate("ab")]
    corpora = [split_indexed_corpus(p, 8, tmp_path / f"packed-{p.name}", VOCAB, 0.25, seed=0) for p in prefixes]
    out = tmp_path / "blend"
    write_blend(corpora, [3.0, 1.0], ["a", "b"], out)  # weights normalise to 0.75 / 0.25
    train = open_split(out, "train")
    assert isinstance(train, BlendedSplit) and len(train) == sum(len(PackedSplit.open(c, "train")) for c in corpora)
    first = len(PackedSplit.open(corpora[0], "train"))
    steps = [train.step_indices(step, 8, seed=5) for step in range(200)]
    rows = np.concatenate(steps)
    share = float((rows < first).mean())
    assert abs(share - 0.75) <= 0.005  # 1600 rows: megatron's greedy blend keeps every prefix within a row
    assert all(abs(float((np.concatenate(steps[:k]) < first).mean()) - 0.75) <= 1 / (8 * k) for k in (1, 10, 50))
    # a resumed run (a fresh process) asks for step 150 first and gets the same rows
    assert BlendedSplit.open(out, "train").step_indices(150, 8, seed=5) == steps[150]
    assert train.step_indices(150, 8, seed=6) != steps[150]  # the seed matters
    # a blend row is the component's own sequence
    component = PackedSplit.open(corpora[1], "train")
    index = next(i for i in steps[0] if i >= first)
    assert train.sequence(index).tolist() == component.sequence(index - first).tolist()
    assert train.batch(steps[0])["attention_mask"].shape == (8, 1, 8, 8)
    validation = open_split(out, "validation")  # the same blend of the validation splits
    assert len(validation) == sum(len(PackedSplit.open(c, "validation")) for c in corpora)
    assert abs(float((np.concatenate(validation.eval_indices(4, 10, seed=5)) < len(
        PackedSplit.open(corpora[0], "validation"))).mean()) - 0.75) <= 0.05


def test_the_data_path_syntax():
    assert parse_data_path("0.7 web_text_document 0.3 code.jsonl") == [(0.7, "web_text_document"),
                                                                       (0.3, "code.jsonl")]
    assert parse_data_path("my corpus.jsonl") == [(1.0, "my corpus.jsonl")]
    with pytest.raises(ValueError, match="weight, path pairs.*odd count"):
        parse_data_path("0.7 a 0.3")
    with pytest.raises(ValueError, match="weight '-1' before 'a' must be a positive number"):
        parse_data_path("-1 a 2 b")


def test_a_bad_prefix_is_refused_with_its_name(tmp_path):
    prefix = write_megatron_corpus(tmp_path / "corpus", random_documents(10, seed=0, high=500))
    with pytest.raises(ValueError, match=r"'.*corpus': token id 4\d\d does not fit the model's vocabulary of 384"):
        split_indexed_corpus(prefix, 8, tmp_path / "packed", VOCAB)
    (tmp_path / "corpus.idx").unlink()
    with pytest.raises(FileNotFoundError, match=r"prefix '.*corpus': .*corpus\.idx not found"):
        split_indexed_corpus(prefix, 8, tmp_path / "packed", VOCAB)
    with pytest.raises(HubError, match=r"dataset id '.*corpus': .*corpus\.idx not found"):
        download_corpus.fn(str(prefix))
    (tmp_path / "corpus.idx").write_bytes(b"not an index")
    with pytest.raises(ValueError, match="not a readable IndexedDataset"):
        split_indexed_corpus(prefix, 8, tmp_path / "packed", VOCAB)
