"""GRPO's arithmetic against trl 1.16 on fixed prompts, completions and rewards: advantages, the clipped
surrogate with the k3 KL term for every loss_type trl has (grpo, dapo, dr_grpo), and the sums that make
micro-batches and ranks add up to one batch."""
from __future__ import annotations

import pytest
import torch

from tiny_models import make_tiny_causal_lm
from twinkle_core.data.encode import IGNORE_INDEX
from twinkle_core.objectives.grpo import completion_logps, grpo_loss_sum
from twinkle_core.rl.grpo import group_advantages, token_terms

REWARDS = torch.tensor([1.0, 0.0, 0.5, 0.5, 2.0, -1.0, 0.0, 3.0])  # 2 prompts x 4 generations


def test_group_advantages_match_trl_and_skip_the_std_on_request():
    from trl.trainer.utils import nanstd

    grouped = REWARDS.view(-1, 4)
    want = ((grouped - grouped.mean(1, keepdim=True)) / (nanstd(grouped, dim=1, keepdim=True) + 1e-4)).view(-1)
    assert torch.allclose(group_advantages(REWARDS, 4), want, atol=1e-6)
    assert torch.allclose(group_advantages(REWARDS, 4, scale_rewards=False),
                          (grouped - grouped.mean(1, keepdim=True)).view(-1))
    assert torch.equal(group_advantages(torch.ones(4), 4), torch.zeros(4))  # one reward for all: no signal
    with pytest.raises(ValueError, match="do not split into groups of num_generations=3"):
        group_advantages(REWARDS, 3)


def _rollout(tokenizer, generator: torch.Generator):
    """trl's layout of 4 sampled completions: left-padded prompts, right-padded completions."""
    vocab = len(tokenizer)
    prompt_ids = torch.randint(5, vocab, (4, 5), generator=generator)
    prompt_mask = torch.ones(4, 5, dtype=torch.long)
    prompt_mask[1, :2] = 0
    prompt_ids[1, :2] = tokenizer.pad_token_id
    completion_ids = torch.randint(5, vocab, (4, 6), generator=generator)
    completion_mask = torch.ones(4, 6, dtype=torch.long)
    completion_mask[0, 4:] = 0
    completion_mask[2, 2:] = 0
    completion_ids[completion_mask == 0] = tokenizer.pad_token_id
    return prompt_ids, prompt_mask, completion_ids, completion_mask


def _ours(prompt_ids, prompt_mask, completion_ids, completion_mask, advantages, old, ref) -> dict:
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    labels = torch.full_like(input_ids, IGNORE_INDEX)
    labels[:, prompt_ids.shape[1]:] = completion_ids.masked_fill(completion_mask == 0, IGNORE_INDEX)

    def aligned(per_token):
        full = torch.zeros(input_ids.shape, dtype=torch.float32)
        full[:, prompt_ids.shape[1]:] = per_token
        return full

    return {"input_ids": input_ids, "attention_mask": torch.cat([prompt_mask, completion_mask], dim=1),
            "labels": labels, "advantages": advantages, "old_logps": aligned(old), "ref_logps": aligned(ref)}


@pytest.mark.parametrize("loss_type,kl_correction", [("grpo", False), ("dapo", False), ("dr_grpo", False),
                                                     ("grpo", True)])
def test_loss_and_kl_equal_trl(tmp_path, loss_type, kl_correction):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    policy, tokenizer = make_tiny_causal_lm("llama", seed=1)
    policy.save_pretrained(tmp_path / "policy")  # with beta > 0 trl loads its reference from the model's path
    tokenizer.save_pretrained(tmp_path / "policy")
    args = GRPOConfig(output_dir=str(tmp_path / "trl"), loss_type=loss_type, beta=0.04, epsilon=0.2, epsilon_high=0.28,
                      num_generations=4, per_device_train_batch_size=4, max_completion_length=6, report_to="none",
                      use_cpu=True, bf16=False, fp16=False, disable_tqdm=True, gradient_checkpointing=False,
                      use_bias_correction_kl=kl_correction)
    trainer = GRPOTrainer(model=str(tmp_path / "policy"), reward_funcs=lambda completions, **_: [0.0] * len(completions), args=args,
                          train_dataset=Dataset.from_list([{"prompt": "hi"}] * 4), processing_class=tokenizer)
    trainer.current_gradient_accumulation_steps = 1
    policy = trainer.model.eval()
    generator = torch.Generator().manual_seed(0)
    prompt_ids, prompt_mask, completion_ids, completion_mask = _rollout(tokenizer, generator)
    advantages = group_advantages(REWARDS[:4], 4)
    with torch.no_grad():
        batch = _ours(prompt_ids, prompt_mask, completion_ids, completion_mask, advantages,
                      torch.zeros(4, 6), torch.zeros(4, 6))
        logps, rows, selected, _ = completion_logps(policy, batch)
        current = torch.zeros(4, 6)
        current[completion_mask.bool()] = logps  # row-major: the same order
    # Old and reference log-probs away from the current ones, so that both clips and the KL term act.
    old = current + 0.3 * torch.randn(4, 6, generator=generator)
    ref = current + 0.5 * torch.randn(4, 6, generator=generator)
    inputs = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
              "completion_mask": completion_mask, "advantages": advantages, "old_per_token_logps": old,
              "ref_per_token_logps": ref, "num_items_in_batch": completion_mask.sum()}
    with torch.no_grad():
        theirs = trainer._compute_loss(trainer.model, inputs)
        batch = _ours(prompt_ids, prompt_mask, completion_ids, completion_mask, advantages, old, ref)
        parts = grpo_loss_sum(policy, batch, loss_type=loss_type, beta=0.04, epsilon=0.2, epsilon_high=0.28,
                              kl_correction=kl_correction, max_completion_length=6)
    ours = float(parts.loss_sum) / parts.num_tokens
    assert abs(ours - float(theirs)) <= 1e-5 * max(1.0, abs(float(theirs))), (ours, float(theirs))
    terms = token_terms(logps, old[completion_mask.bool()], advantages[rows], ref[completion_mask.bool()],
                        epsilon=0.2, epsilon_high=0.28, beta=0.04, kl_correction=kl_correction)
    logged = trainer._metrics["eval"]  # trl files an eval-mode model's metrics as eval
    assert float(terms.kl.mean()) == pytest.approx(logged["kl"][-1], rel=1e-5)
    assert float(terms.clipped.mean()) == pytest.approx(logged["clip_ratio/region_mean"][-1],
                                                        rel=1e-5, abs=1e-7)
    assert 0 < float(terms.clipped.mean()) < 1  # the clip acted on some tokens and not on others


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
def test_micro_batches_add_up_to_the_whole_batch(loss_type):
    """Sums and counts over two halves equal the whole batch's: what accumulation and DP rely on."""
    policy, tokenizer = make_tiny_causal_lm("llama", seed=3)
    prompt_ids, prompt_mask, completion_ids, completion_mask = _rollout(tokenizer, torch.Generator().manual_seed(1))
    advantages = group_advantages(REWARDS[4:], 4)
    batch = _ours(prompt_ids, prompt_mask, completion_ids, completion_mask, advantages, torch.zeros(4, 6),
                  torch.zeros(4, 6))
    del batch["old_logps"], batch["ref_logps"]  # first pass: old = current, detached; no KL
    options = dict(loss_type=loss_type, max_completion_length=6)
    whole = grpo_loss_sum(policy, batch, **options)
    halves = [grpo_loss_sum(policy, {k: v[i:i + 2] for k, v in batch.items()}, **options) for i in (0, 2)]
    assert sum(p.num_tokens for p in halves) == whole.num_tokens
    total = sum(float(p.loss_sum) for p in halves)
    assert abs(total - float(whole.loss_sum)) <= 1e-6 * max(1.0, abs(total))
    # With old = current the ratio is 1: the loss is -mean advantage (grpo: per sequence), its gradient is not 0.
    whole.loss_sum.backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in policy.parameters())


def test_bad_options_are_refused():
    from twinkle_core.objectives.grpo import resolve_options

    for options, words in [({"loss_type": "bnpo"}, "loss_type='bnpo': choose one of grpo, dapo, dr_grpo"),
                           ({"epsilon": 0.2, "epsilon_high": 0.1}, "epsilon_high=0.1 must be >= epsilon=0.2"),
                           ({"beta": -1}, "beta=-1 must be >= 0"),
                           ({"num_generations": 1}, "num_generations=1: a group needs >= 2 completions")]:
        with pytest.raises(ValueError, match=words):
            resolve_options(None, None, options)
    assert resolve_options(None, None, {"loss_type": "dr_grpo", "max_new_tokens": 24})["max_completion_length"] == 24


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_padding_free_groups_hold_each_prompt_once_and_train_like_padded_rows(tmp_path, loss_type):
    """The rollout's default batch: a group's prompt once, its other completions attending to it; the loss (with
    the KL to the adapter-off reference and old log-probs) and the adapter after 3 steps equal the padded rows'
    (fp32, 1e-5)."""
    from peft import LoraConfig

    from tiny_models import save_tiny_model
    from twinkle_core.models import TransformersModel
    from twinkle_core.rl.sampler import completion_batch, completion_batch_padding_free

    path = save_tiny_model(tmp_path / "llama", "llama")
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 60, (n,), generator=generator).tolist() for n in (7, 12)]
    completions = [torch.randint(5, 60, (n,), generator=generator).tolist() for n in (3, 5, 1, 4, 6, 2, 5, 3)]
    advantages = group_advantages(REWARDS, 4)

    def trained(padding_free: bool):
        torch.manual_seed(0)
        model = TransformersModel(str(path), objective="grpo", mixed_precision="no", padding_free=padding_free,
                                  objective_options={"loss_type": loss_type, "beta": 0.04})
        model.add_adapter_to_model("default", LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False))
        model.set_optimizer("AdamW", lr=1e-2)
        batch = completion_batch_padding_free(prompts, completions, 4) if padding_free else \
            completion_batch(prompts, completions, 4, model.tokenizer.pad_token_id)
        batch["advantages"] = advantages
        with torch.no_grad():
            logps, _, selected, _ = completion_logps(model.model, batch)
        batch["old_logps"] = torch.zeros(batch["labels"].shape)
        batch["old_logps"][:, 1:][selected] = logps + 0.05  # a stale policy: the ratio is not 1
        losses = []
        for _ in range(3):
            losses.append(float(model.forward_backward(dict(batch))))
            model.clip_grad_and_step(1.0)
        return batch, losses, {n: p.detach() for n, p in model.model.named_parameters() if p.requires_grad}

    (padded, reference, ref_adapter), (free, losses, adapter) = trained(False), trained(True)
    assert _holds_each_prompt_once(free, prompts, completions)
    assert losses == pytest.approx(reference, rel=1e-5) and losses[-1] != losses[0]
    for name, value in ref_adapter.items():
        torch.testing.assert_close(adapter[name], value, rtol=1e-5, atol=1e-6)


def _holds_each_prompt_once(batch: dict, prompts: list[list[int]], completions: list[list[int]]) -> bool:
    """The row holds each prompt once but its last token, which every other completion of the group repeats."""
    whole = sum(len(p) * 4 for p in prompts) + sum(len(c) for c in completions)
    shared = sum((len(p) - 1) * 3 for p in prompts)
    return batch["input_ids"].shape == (1, whole - shared) and batch["prefix_spans"][:, 1].tolist() == \
        [0, 6, 6, 6, 0, 11, 11, 11]
