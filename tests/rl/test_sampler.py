"""The rollout sampler against transformers' generate: one prefill per prompt shared by its group, finished rows
leaving the batch, and the same completions as generate where both are deterministic (greedy)."""
from __future__ import annotations

import pytest
import torch

from tiny_models import make_tiny_causal_lm
from twinkle_core.rl.sampler import PolicySampler, SamplingSettings

PROMPTS = [[5, 9, 13, 2, 7], [11, 4], [8, 8, 3, 21]]  # uneven lengths: left padding
NEVER = 999  # an end-of-sequence id outside the vocabulary


def _sampler(model, eos: list[int]) -> PolicySampler:
    return PolicySampler(model, pad_token_id=0, eos_token_ids=eos, device=torch.device("cpu"))


def _greedy_tokens(model, steps: int) -> list[list[int]]:
    """What greedy decoding writes with an end-of-sequence token that never comes."""
    return _sampler(model, [NEVER]).sample(PROMPTS, 1, SamplingSettings(steps, temperature=0), seed=0)


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_greedy_completions_equal_generate_with_rows_stopping_at_different_steps(model_type):
    model = make_tiny_causal_lm(model_type, vocab_size=64)[0].eval()
    never = _greedy_tokens(model, 12)
    # an end-of-sequence token that some rows write early and others never: rows leave the batch one by one
    stop = never[0][3]
    sampler = _sampler(model, [stop])
    settings = SamplingSettings(12, temperature=0)
    ours = sampler.sample(PROMPTS, 2, settings, seed=0)
    # generate has no greedy groups: the same prompts repeated
    reference = sampler._generate(*_left_padded([p for p in PROMPTS for _ in range(2)]), 1, settings)
    assert ours == reference
    lengths = {len(c) for c in ours}
    assert len(lengths) > 1 and min(lengths) <= 4  # some stopped early, some ran on
    assert all(c[-1] == stop or len(c) == 12 for c in ours) and all(stop not in c[:-1] for c in ours)


def _left_padded(prompts):
    width = max(map(len, prompts))
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    return ids, mask


def test_each_prompt_runs_once_and_finished_rows_are_not_computed():
    model = make_tiny_causal_lm("llama", vocab_size=64)[0].eval()
    stop = _greedy_tokens(model, 8)[1][0]  # the second prompt's first greedy token
    rows_seen = []
    hook = model.model.register_forward_pre_hook(lambda _m, _a, kw: rows_seen.append(kw["input_ids"].shape),
                                                 with_kwargs=True)
    try:
        _sampler(model, [stop]).sample(PROMPTS, 4, SamplingSettings(8, temperature=0), seed=0)
    finally:
        hook.remove()
    assert rows_seen[0] == (3, 5)  # the prefill: 3 prompts once each, not 12 copies
    assert rows_seen[1][0] == 8  # the second prompt's 4 rows stopped at their first token
    assert all(shape[1] == 1 for shape in rows_seen[1:])


def test_sampling_is_seeded_and_follows_the_temperature():
    model = make_tiny_causal_lm("llama", vocab_size=64)[0].eval()
    sampler = _sampler(model, [NEVER])
    hot = SamplingSettings(6, temperature=1.0, top_p=0.9)
    first = sampler.sample(PROMPTS, 4, hot, seed=3)
    assert first == sampler.sample(PROMPTS, 4, hot, seed=3)
    assert first != sampler.sample(PROMPTS, 4, hot, seed=4)
    assert len(first) == 12 and all(len(c) == 6 for c in first)
    cold = sampler.sample(PROMPTS, 4, SamplingSettings(6, temperature=1e-4), seed=3)
    greedy = sampler.sample(PROMPTS, 1, SamplingSettings(6, temperature=0), seed=0)
    assert cold == [row for row in greedy for _ in range(4)]  # a near-zero temperature samples the argmax


def test_first_tokens_follow_the_tempered_top_p_distribution():
    """4,000 one-token samples of one prompt against softmax(top_p(logits / T)) as transformers computes it."""
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper

    model = make_tiny_causal_lm("llama", vocab_size=64)[0].eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([PROMPTS[0]])).logits[:, -1].float()
    want = torch.softmax(TopPLogitsWarper(0.8)(None, TemperatureLogitsWarper(0.7)(None, logits)), -1)[0]
    tokens = _sampler(model, [NEVER]).sample(PROMPTS[:1], 4000, SamplingSettings(1, 0.7, 0.8), seed=0)
    got = torch.bincount(torch.tensor([t[0] for t in tokens]), minlength=64).float() / 4000
    assert (got[want == 0] == 0).all()  # nothing outside the top-p nucleus
    assert (got - want).abs().max() < 0.03


def test_recurrent_layers_sample_through_generate():
    """Qwen 3.5's gated-delta-net layers keep a state, not keys and values: such models take generate's path."""
    model = make_tiny_causal_lm(
        "qwen3_5_text", vocab_size=64, layer_types=["linear_attention", "full_attention"], head_dim=8,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
        linear_conv_kernel_dim=4)[0].eval()
    sampler = _sampler(model, [NEVER])
    assert sampler._key_value_cache() is None
    greedy = SamplingSettings(4, temperature=0)
    assert sampler.sample(PROMPTS, 1, greedy, seed=0) == sampler._generate(*_left_padded(PROMPTS), 1, greedy)
    assert _sampler(make_tiny_causal_lm("llama", vocab_size=64)[0], [NEVER])._key_value_cache() is not None
