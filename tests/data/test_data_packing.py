"""Packing and batching: boundaries, padding values, and packed logits equal to each sample run alone."""
from __future__ import annotations

import pytest
import torch
from tiny_models import make_tiny_causal_lm

from twinkle_core.data import collate, count_trained_tokens, encode_text, pack_examples

TEXTS = [
    "The capital of France is Paris.",
    "Who are you? I am Twinkle.",
    "Hello there, how can I help you today?",
    "Paris!",
]


def _example(length, start=10):
    ids = list(range(start, start + length))
    return {"input_ids": ids, "labels": list(ids)}


def test_pack_restarts_positions_and_masks_first_labels():
    packs = pack_examples([_example(3), _example(4, 20), _example(5, 30), _example(2, 40)], max_length=8)
    assert [pack["input_ids"] for pack in packs] == [[10, 11, 12, 20, 21, 22, 23], [30, 31, 32, 33, 34, 40, 41]]
    assert packs[0]["position_ids"] == [0, 1, 2, 0, 1, 2, 3]
    assert packs[1]["position_ids"] == [0, 1, 2, 3, 4, 0, 1]
    assert packs[0]["labels"] == [-100, 11, 12, -100, 21, 22, 23]
    assert packs[1]["labels"] == [-100, 31, 32, 33, 34, -100, 41]
    with pytest.raises(ValueError, match="example 1 has 9 tokens; packing needs 1..max_length=8"):
        pack_examples([_example(3), _example(9)], max_length=8)


def test_collate_pads_plain_examples():
    batch = collate([_example(3), _example(5, 20)], pad_token_id=0, pad_to_multiple_of=4)
    assert batch["input_ids"].tolist() == [[10, 11, 12, 0, 0, 0, 0, 0], [20, 21, 22, 23, 24, 0, 0, 0]]
    assert batch["labels"].tolist() == [[10, 11, 12] + [-100] * 5, [20, 21, 22, 23, 24] + [-100] * 3]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 0, 0, 0]]
    assert "position_ids" not in batch
    assert count_trained_tokens(batch["labels"]) == 2 + 4
    with pytest.raises(ValueError, match="pad_token_id is None"):
        collate([_example(3)], pad_token_id=None)


def test_collate_builds_a_block_diagonal_mask_for_packed_examples():
    packs = pack_examples([_example(2), _example(2, 20), _example(3, 30)], max_length=4)
    batch = collate(packs, pad_token_id=0)
    assert batch["input_ids"].tolist() == [[10, 11, 20, 21], [30, 31, 32, 0]]
    assert batch["position_ids"].tolist() == [[0, 1, 0, 1], [0, 1, 2, 0]]
    assert batch["labels"].tolist() == [[-100, 11, -100, 21], [-100, 31, 32, -100]]
    mask = batch["attention_mask"]
    assert mask.shape == (2, 1, 4, 4) and mask.dtype == torch.float32
    allowed = (mask[:, 0] == 0).int().tolist()
    assert allowed[0] == [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]]
    assert allowed[1] == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [0, 0, 0, 1]]  # padding sees itself only
    assert mask.min() == torch.finfo(torch.float32).min
    assert collate(packs, 0, mask_dtype=torch.bfloat16)["attention_mask"].dtype == torch.bfloat16
    with pytest.raises(ValueError, match="mixes packed examples"):
        collate([packs[0], _example(2)], pad_token_id=0)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_packed_logits_and_loss_match_each_sample_alone(attention):
    model, tokenizer = make_tiny_causal_lm("llama")
    model.set_attn_implementation(attention)
    model.eval()
    examples = [encode_text(tokenizer, text) for text in TEXTS]
    lengths = [len(example["input_ids"]) for example in examples]
    packs = pack_examples(examples, max_length=lengths[0] + lengths[1])
    assert [len(pack["position_ids"]) for pack in packs] == [lengths[0] + lengths[1], lengths[2] + lengths[3]]
    assert lengths[2] + lengths[3] < lengths[0] + lengths[1]  # the second row is padded
    batch = collate(packs, tokenizer.pad_token_id)
    with torch.no_grad():
        packed = model(**batch)
        alone = [model(input_ids=torch.tensor([e["input_ids"]]), labels=torch.tensor([e["labels"]])) for e in examples]
        unmasked = model(input_ids=batch["input_ids"]).logits
    for index, (row, start) in enumerate([(0, 0), (0, lengths[0]), (1, 0), (1, lengths[2])]):
        got = packed.logits[row, start : start + lengths[index]]
        torch.testing.assert_close(got, alone[index].logits[0], atol=1e-5, rtol=0)
    # Without the mask the second sample would attend to the first: the test can tell the difference.
    assert not torch.allclose(unmasked[0, lengths[0] :], packed.logits[0, lengths[0] :], atol=1e-3)
    # Same mean loss over the same trained tokens.
    counts = [count_trained_tokens(e["labels"]) for e in examples]
    assert count_trained_tokens(batch["labels"]) == sum(counts)
    expected = sum(out.loss * n for out, n in zip(alone, counts)) / sum(counts)
    torch.testing.assert_close(packed.loss, expected, atol=1e-5, rtol=0)


def test_packing_is_refused_where_recurrent_layers_would_carry_one_sample_into_the_next(tmp_path):
    """Qwen 3.5's gated-delta-net layers run along the whole packed row: the block mask keeps samples apart in
    its attention layers only, so the second sample's logits change with the first. Packing is refused there."""
    from family_models import save_tiny_family_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from flows.sft import SFTConfig
    from twinkle_core.train.checks import run_problems

    folder = save_tiny_family_model("qwen3_5", tmp_path / "qwen3_5")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    first, second = _example(12, 10), _example(9, 60)
    batch = collate(pack_examples([first, second], max_length=21), pad_token_id=0)
    with torch.no_grad():
        packed = model(**{k: v for k, v in batch.items() if k != "labels"}).logits[0, 12:]
        alone = model(input_ids=torch.tensor([second["input_ids"]])).logits[0]
    assert (packed - alone).abs().max() > 1e-4  # the leak (attention-only models agree within 1e-5, above)

    (tmp_path / "rows.jsonl").write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}\n')
    config = SFTConfig(model_id=str(folder), dataset=str(tmp_path / "rows.jsonl"), packing=True)
    problems = run_problems(config, AutoConfig.from_pretrained(folder))
    assert [p for p in problems if p.startswith("packing=True")] == [
        "packing=True: this model's linear_attention layers carry their state from one packed sample into the next "
        "(a mask keeps samples apart in attention only; transformers separates them there only with "
        "flash-linear-attention kernels and cu_seqlens, not used here); use packing=false"]
    unpacked = SFTConfig(model_id=str(folder), dataset=str(tmp_path / "rows.jsonl"))
    assert not [p for p in run_problems(unpacked, AutoConfig.from_pretrained(folder)) if "packing" in p]
