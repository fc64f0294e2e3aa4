"""Preference objectives on a tiny Llama: the loss, rewards and accuracy against trl on the same batch,
the reference (the base under a disabled adapter, a frozen copy, precomputed), exact accumulation, and
the preference row kind's layouts and bad rows."""
from __future__ import annotations

import json

import pytest
import torch

from tiny_models import make_tiny_causal_lm, save_tiny_model
from twinkle_core.data import DatasetError, load_tokenized, tokenize_dataset
from twinkle_core.data.encode import IGNORE_INDEX
from twinkle_core.data.preference import collate_preferences, encode_preference_row, validate_preference_row
from twinkle_core.models import LoraConfig, TransformersModel
from twinkle_core.objectives.preference import METRICS as METRIC_NAMES
from twinkle_core.objectives.preference import preference_loss_sum, reference_logps, sequence_logps

PAIRS = [
    {"prompt": [{"role": "user", "content": "Who are you?"}],
     "chosen": [{"role": "assistant", "content": "I am Twinkle."}],
     "rejected": [{"role": "assistant", "content": "I am a model."}]},
    {"prompt": [{"role": "user", "content": "What is your name?"}],
     "chosen": [{"role": "assistant", "content": "Twinkle."}],
     "rejected": [{"role": "assistant", "content": "Hello there, how can I help you today?"}]},
    {"prompt": [{"role": "user", "content": "Where is Paris?"}],
     "chosen": [{"role": "assistant", "content": "In France."}],
     "rejected": [{"role": "assistant", "content": "Paris is the capital of data tokens."}]},
]
TRL_METRICS = {"rewards/chosen": "rewards/chosen", "rewards/rejected": "rewards/rejected",
               "rewards/margin": "rewards/margins", "rewards/accuracy": "rewards/accuracies",
               "logps/chosen": "logps/chosen", "logps/rejected": "logps/rejected"}


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TWINKLE_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("llama") / "llama", "llama")


def _policy_and_reference():
    """Two different tiny Llamas of one tokenizer, so rewards and margins are not zero."""
    policy, tokenizer = make_tiny_causal_lm("llama", seed=1)
    reference, _ = make_tiny_causal_lm("llama", seed=2)
    return policy.eval(), reference.eval(), tokenizer


def _ours(batch: dict, pairs: int) -> dict:
    """trl's [chosen..., rejected...] batch in our form: labels are the completion tokens."""
    labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, IGNORE_INDEX)
    return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"], "labels": labels,
            "pair_valid": torch.ones(pairs, dtype=torch.bool)}


def _compare(parts, theirs_loss, theirs_metrics, pairs):
    ours_loss = float(parts.loss_sum) / parts.num_tokens
    assert abs(ours_loss - float(theirs_loss)) <= 1e-5 * max(1.0, abs(float(theirs_loss)))
    for name, trl_name in TRL_METRICS.items():
        got, want = parts.metrics[name] / pairs, theirs_metrics[trl_name][-1]
        assert abs(got - want) <= 1e-5 * max(1.0, abs(want)), f"{name}: ours {got} vs trl {want}"


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_dpo_losses_equal_trl(tmp_path, loss_type):
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    policy, reference, tokenizer = _policy_and_reference()
    args = DPOConfig(output_dir=str(tmp_path / "trl"), beta=0.2, loss_type=[loss_type], report_to="none",
                     per_device_train_batch_size=len(PAIRS), use_cpu=True, bf16=False, fp16=False, disable_tqdm=True)
    trainer = DPOTrainer(model=policy, ref_model=reference, args=args, train_dataset=Dataset.from_list(PAIRS),
                         processing_class=tokenizer)
    batch = next(iter(trainer.get_train_dataloader()))
    with torch.no_grad():
        theirs = trainer.compute_loss(trainer.model, batch)
        ours = _ours(batch, len(PAIRS))
        ours["ref_chosen_logps"], ours["ref_rejected_logps"] = sequence_logps(reference, ours)[0].chunk(2)
        parts = preference_loss_sum(policy, ours, loss_type=loss_type, beta=0.2)
    assert parts.num_tokens == len(PAIRS)
    assert 0 < parts.metrics["rewards/accuracy"] < len(PAIRS) or parts.metrics["rewards/margin"] != 0
    _compare(parts, theirs, trainer._metrics["eval"], len(PAIRS))  # trl files an eval-mode model's metrics as eval


def test_simpo_equals_trl_cpo(tmp_path):
    from datasets import Dataset
    from trl.experimental.cpo import CPOConfig, CPOTrainer

    policy, _, tokenizer = _policy_and_reference()
    args = CPOConfig(output_dir=str(tmp_path / "trl"), loss_type="simpo", cpo_alpha=0.0, beta=2.0, simpo_gamma=0.8,
                     report_to="none", per_device_train_batch_size=len(PAIRS), use_cpu=True, bf16=False, fp16=False,
                     disable_tqdm=True, max_length=128)
    trainer = CPOTrainer(model=policy, args=args, train_dataset=Dataset.from_list(PAIRS), processing_class=tokenizer)
    batch = next(iter(trainer.get_train_dataloader()))
    with torch.no_grad():
        theirs, metrics = trainer.get_batch_loss_metrics(trainer.model, batch)
        concatenated = trainer.concatenated_inputs(batch, padding_value=trainer.pad_token_id)
        labels = concatenated["concatenated_labels"]
        ours = {"input_ids": concatenated["concatenated_input_ids"], "labels": labels,
                "attention_mask": concatenated["concatenated_attention_mask"]}
        parts = preference_loss_sum(policy, ours, loss_type="simpo", beta=2.0, simpo_gamma=0.8)
    _compare(parts, theirs, {TRL_METRICS[k]: [v] for k, v in _trl_cpo_means(metrics).items()}, len(PAIRS))


def _trl_cpo_means(metrics: dict) -> dict:
    return {ours: metrics[theirs] for ours, theirs in TRL_METRICS.items()}


def test_lora_reference_is_the_base_without_a_copy(llama):
    rows = [_ours_row(pair) for pair in PAIRS]
    model = TransformersModel(str(llama), objective="preference", mixed_precision="no")
    base_logps = _logps(model, rows)
    model.add_adapter_to_model("default", LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False))
    model.set_optimizer("AdamW", lr=1e-2)
    assert not hasattr(model.model, "_twinkle_reference_model")  # no second copy with LoRA
    batch = model._batch(rows)
    policy, _ = sequence_logps(model.model, batch)
    torch.testing.assert_close(reference_logps(model.model, batch), base_logps, rtol=0, atol=0)
    assert (policy - base_logps).abs().max() > 1e-3  # the random adapter changes the policy
    first = model.forward_backward(rows)
    model.clip_grad_and_step(1.0)
    metrics = model.calculate_metric()
    assert abs(metrics["rewards/margin"] - _margin(policy, base_logps, 0.1)) < 1e-5
    for _ in range(4):
        last = model.forward_backward(rows)
        model.clip_grad_and_step(1.0)
    assert last < first and model.calculate_metric()["rewards/accuracy"] == 1.0


@pytest.mark.parametrize("loss_type", ["sigmoid", "simpo"])
def test_padding_free_pairs_hold_each_prompt_once_and_train_like_padded_ones(llama, loss_type):
    """The default padding-free batch: chosen sequences whole, each rejected reply continuing its pair's prompt
    (not repeated); losses, metrics and the adapter after 3 steps equal the padded batch's (fp32, 1e-5)."""
    rows = [_ours_row(pair) for pair in PAIRS]

    def trained(padding_free: bool):
        torch.manual_seed(0)
        model = TransformersModel(str(llama), objective="preference", mixed_precision="no", padding_free=padding_free,
                                  objective_options={"loss_type": loss_type, "beta": 0.5})
        model.add_adapter_to_model("default", LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False))
        model.set_optimizer("AdamW", lr=1e-2)
        losses = []
        for _ in range(3):
            losses.append(float(model.forward_backward(rows)))
            model.clip_grad_and_step(1.0)
        adapter = {n: p.detach().clone() for n, p in model.model.named_parameters() if p.requires_grad}
        return model, losses, model.calculate_metric(), adapter

    padded, free = trained(False), trained(True)
    batch = free[0]._batch(rows)
    sequences = padded[0]._batch(rows)["attention_mask"].sum(dim=1)
    prompts = batch["prefix_spans"][len(rows):, 1]
    assert (prompts > 0).all() and batch["input_ids"].shape == (1, int(sequences.sum() - prompts.sum()))
    assert free[1] == pytest.approx(padded[1], rel=1e-5) and free[1][-1] < free[1][0]
    for name in METRIC_NAMES:
        assert free[2][name] == pytest.approx(padded[2][name], rel=1e-5, abs=1e-6), name
    for name, value in padded[3].items():
        torch.testing.assert_close(free[3][name], value, rtol=1e-5, atol=1e-6)


def test_full_training_reference_is_a_frozen_copy(llama):
    rows = [_ours_row(pair) for pair in PAIRS]
    model = TransformersModel(str(llama), objective="preference", mixed_precision="no",
                              objective_options={"loss_type": "ipo", "beta": 0.5})
    before = _logps(model, rows)
    model.set_optimizer("AdamW", lr=1e-2)
    for _ in range(3):
        model.forward_backward(rows)
        model.clip_grad_and_step(1.0)
    batch = model._batch(rows)
    torch.testing.assert_close(reference_logps(model.model, batch), before, rtol=0, atol=0)
    assert (sequence_logps(model.model, batch)[0] - before).abs().max() > 1e-3


def test_accumulation_is_exact_and_precomputed_reference_equals_the_adapter_off(llama):
    rows = [_ours_row(pair) for pair in PAIRS] + [_ours_row(PAIRS[0], chosen="Twinkle, built by the team.")]

    def trained(micro_batches: list[list[dict]], precomputed: bool) -> dict:
        torch.manual_seed(0)
        model = TransformersModel(str(llama), objective="preference", mixed_precision="no",
                                  objective_options={"precompute_reference": precomputed})
        model.add_adapter_to_model("default", LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False),
                                   gradient_accumulation_steps=len(micro_batches))
        model.set_optimizer("SGD", lr=0.5)
        for chunk in micro_batches:
            inputs = chunk
            if precomputed:
                with torch.no_grad():
                    batch = model._batch(chunk)
                    with model.model.disable_adapter():
                        ref = sequence_logps(model.model, batch)[0]
                inputs = {**batch, "ref_chosen_logps": ref[:len(chunk)], "ref_rejected_logps": ref[len(chunk):]}
            model.forward_backward(inputs)
        assert model.clip_grad_and_step(None)
        return {n: p.detach().clone() for n, p in model.model.named_parameters() if p.requires_grad}

    one = trained([rows], False)
    for got in (trained([rows[:1], rows[1:]], False), trained([rows[:2], rows[2:]], True)):
        for name, value in one.items():
            torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="precompute_reference=True, but the batch has no ref_chosen_logps"):
        model = TransformersModel(str(llama), objective="preference", mixed_precision="no",
                                  objective_options={"precompute_reference": True})
        model.add_adapter_to_model("default", LoraConfig(r=4, target_modules="all-linear"))
        model.set_optimizer("AdamW", lr=1e-3)
        model.forward_backward(rows)


def test_bad_options_are_refused(llama):
    for options, words in [({"loss_type": "kto"}, "loss_type='kto': choose one of sigmoid, ipo, simpo, orpo"),
                           ({"beta": 0}, "beta=0.0 must be > 0"),
                           ({"loss_type": "simpo", "precompute_reference": True}, "uses no reference model")]:
        with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
            TransformersModel(str(llama), objective="preference", mixed_precision="no", objective_options=options)


def test_orpo_and_rpo_add_the_chosen_nll(llama):
    model = TransformersModel(str(llama), objective="preference", mixed_precision="no")
    batch = model._batch([_ours_row(pair) for pair in PAIRS])
    logps, tokens = sequence_logps(model.model, batch)
    n = len(PAIRS)
    nll = float((-logps[:n] / tokens[:n]).sum())
    batch = {**batch, "ref_chosen_logps": logps[:n].detach() - 0.5, "ref_rejected_logps": logps[n:].detach() + 0.5}
    with torch.no_grad():
        plain = preference_loss_sum(model.model, batch, loss_type="sigmoid", beta=0.1)
        rpo = preference_loss_sum(model.model, batch, loss_type="sigmoid", beta=0.1, rpo_alpha=0.5)
        orpo = preference_loss_sum(model.model, batch, loss_type="orpo", beta=0.1)
    assert abs(float(rpo.loss_sum) - float(plain.loss_sum) - 0.5 * nll) < 1e-4
    mean_c, mean_r = logps[:n] / tokens[:n], logps[n:] / tokens[n:]
    log_odds = (mean_c - mean_r) - (torch.log1p(-mean_c.exp()) - torch.log1p(-mean_r.exp()))
    want = nll - 0.1 * float(torch.nn.functional.logsigmoid(log_odds).sum())
    assert abs(float(orpo.loss_sum) - want) < 1e-4


def test_layouts_labels_and_bad_rows(llama, tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(llama)
    prompt = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello there"},
              {"role": "user", "content": "Who are you?"}]
    ours = validate_preference_row({"messages": prompt, "chosen": "I am Twinkle.", "rejected": "I am a model."})
    trl = validate_preference_row({"prompt": prompt, "chosen": [{"role": "assistant", "content": "I am Twinkle."}],
                                   "rejected": [{"role": "assistant", "content": "I am a model."}]})
    swift = validate_preference_row({"messages": prompt + [{"role": "assistant", "content": "I am Twinkle."}],
                                     "rejected_response": "I am a model."})
    assert ours == trl == swift
    example = encode_preference_row(tokenizer, ours)
    labelled = tokenizer.decode([t for t in example["chosen_labels"] if t != IGNORE_INDEX])
    assert labelled.startswith("I am Twinkle.") and "Hello there" not in labelled  # the final reply only
    batch = collate_preferences([example, example], tokenizer.pad_token_id)
    assert batch["input_ids"].shape[0] == 4 and batch["pair_valid"].tolist() == [True, True]

    rows = [{"messages": prompt, "chosen": "A.", "rejected": "B."},
            {"prompt": "Who?", "chosen": "Twinkle.", "rejected": "Twinkle."},
            {"prompt": "Who?", "chosen": "Twinkle."},
            {"messages": [{"role": "user", "content": "x"}], "chosen": "", "rejected": "B."},
            {"prompt": "Who?", "chosen": "Twinkle.", "rejected": "Nobody."}]
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows) + "{not json\n")
    tokenized = tokenize_dataset(path, llama, kind="preference", max_length=64, max_bad_fraction=0.7)
    assert [bad.line for bad in tokenized.bad] == [2, 3, 4, 6]
    assert "identical" in tokenized.bad[0].reason and "needs 'messages'" in tokenized.bad[1].reason
    assert len(load_tokenized(tokenized)) == 2
    with pytest.raises(DatasetError, match=r"pairs.jsonl:2: chosen and rejected replies are identical"):
        tokenize_dataset(path, llama, kind="preference", max_length=64, max_bad_fraction=0.1)


def _ours_row(pair: dict, chosen: str | None = None) -> dict:
    return {"messages": pair["prompt"], "chosen": chosen or pair["chosen"][0]["content"],
            "rejected": pair["rejected"][0]["content"]}


def _logps(model: TransformersModel, rows: list[dict]) -> torch.Tensor:
    with torch.no_grad():
        return sequence_logps(model.model, model._batch(rows))[0]


def _margin(policy: torch.Tensor, reference: torch.Tensor, beta: float) -> float:
    n = policy.shape[0] // 2
    ratio = policy - reference
    return float((beta * (ratio[:n] - ratio[n:])).mean())
