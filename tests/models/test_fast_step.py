"""The faster SFT step is the same step: padding-free batches (with a shared prompt prefix held once), the chunked
output-layer loss, the math attention path and length-grouped order each give today's losses and weights (fp32,
within 1e-5), on a tiny real Llama."""
import json

import pytest
import torch
import torch.nn.functional as F
from peft import LoraConfig
from torch.utils._python_dispatch import TorchDispatchMode

from tiny_models import SAMPLE_ROWS as ROWS
from tiny_models import save_tiny_model
from twinkle_core.data import device_batch
from twinkle_core.data import collate, collate_padding_free, encode_chat, pack_examples, shared_prefix_length
from twinkle_core.models import TransformersModel
from twinkle_core.objectives.linear_ce import linear_cross_entropy_sum
from twinkle_core.parallel import local_micro_batches


def _model(path, lora=True, padding_free=True, seed=0, **kw):
    torch.manual_seed(seed)
    model = TransformersModel(str(path), mixed_precision="no", padding_free=padding_free, **kw)
    if lora:
        model.add_adapter_to_model("default", LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    model.set_optimizer("AdamW", lr=1e-2)
    return model


def _examples(model, system: str | None = None):
    """The sample rows; with `system`, each opens with that system prompt (a prefix the rows share)."""
    rows = [[m for m in row["messages"] if m["role"] != "system"] for row in ROWS] if system else \
        [row["messages"] for row in ROWS]
    return [encode_chat(model.tokenizer, [{"role": "system", "content": system}] * bool(system) + messages)
            for messages in rows]


def _train(model, batch, steps=3):
    losses = []
    for _ in range(steps):
        losses.append(float(model.forward_backward(dict(batch))))
        model.clip_grad_and_step(1.0)
    return losses


def _force_attention_path(monkeypatch, path: str) -> None:
    """twinkle_sdpa's path for the short test rows: math (as chosen), the flash kernel, or one call per sample."""
    from twinkle_core.models import attention

    if path == "flash":
        monkeypatch.setattr(attention, "MATH_ATTENTION_SCORES", 0)
    if path == "per-sample":
        monkeypatch.setattr(attention, "LOOP_MIN_LENGTH", 1)
        monkeypatch.setattr(attention, "LOOP_WASTE", 0.0)


@pytest.mark.parametrize("lora, path", [(True, "math"), (False, "math"), (True, "flash"), (True, "per-sample")])
def test_padding_free_batches_train_exactly_like_padded_ones(tiny_model_dir, lora, path, monkeypatch):
    """Each of twinkle_sdpa's paths: short samples as one padded kernel call (math or flash kernel), or one
    call per sample (long uneven samples; forced here on short ones)."""
    _force_attention_path(monkeypatch, path)
    padded, free = _model(tiny_model_dir, lora, padding_free=False), _model(tiny_model_dir, lora)
    assert free.padding_free and not padded.padding_free
    examples = _examples(free)
    assert len({len(e["input_ids"]) for e in examples}) > 1  # the padded batch really pads
    batch = collate_padding_free(examples, share_prefix=False)
    assert batch["input_ids"].shape == (1, sum(len(e["input_ids"]) for e in examples))
    reference = _train(padded, collate(examples, pad_token_id=padded.tokenizer.pad_token_id))
    losses = _train(free, batch)
    assert losses == pytest.approx(reference, rel=1e-5)
    assert losses[-1] < losses[0]
    for (name, a), b in zip(padded.model.named_parameters(), free.model.parameters()):
        assert torch.allclose(a, b, atol=1e-5), name


@pytest.mark.parametrize("lora, path", [(True, "math"), (False, "math"), (True, "flash"), (True, "per-sample")])
def test_a_shared_prompt_prefix_runs_once_and_trains_exactly_like_padded_rows(tiny_model_dir, lora, path,
                                                                              monkeypatch):
    """Rows opening with the same system prompt: the padding-free row holds that prefix once (later samples attend
    to it), and the losses, weights and counted tokens are those of the padded batch (fp32, 1e-5), on each of
    twinkle_sdpa's paths."""
    from twinkle_core.models.batches import count_input_tokens

    _force_attention_path(monkeypatch, path)
    padded, free = _model(tiny_model_dir, lora, padding_free=False), _model(tiny_model_dir, lora)
    examples = _examples(free, system="You are Twinkle, a careful assistant made by the Twinkle Flows team.")
    prefix = shared_prefix_length(examples)
    assert prefix > 30  # the template's header and the whole system prompt
    batch = collate_padding_free(examples)
    assert batch["prefix_spans"].tolist() == [[0, 0]] + [[0, prefix]] * 3
    assert batch["input_ids"].shape == (1, sum(len(e["input_ids"]) for e in examples) - 3 * prefix)
    assert batch["position_ids"][0, batch["cu_seq_lens_q"][1]] == prefix  # the second sample goes on from the prefix
    reference_batch = collate(examples, pad_token_id=padded.tokenizer.pad_token_id)
    assert count_input_tokens(batch) == count_input_tokens(reference_batch)
    reference = _train(padded, reference_batch)
    losses = _train(free, batch)
    assert losses == pytest.approx(reference, rel=1e-5)
    assert losses[-1] < losses[0]
    for (name, a), b in zip(padded.model.named_parameters(), free.model.parameters()):
        assert torch.allclose(a, b, atol=1e-5), name


@pytest.mark.parametrize("lora, path", [(True, "math"), (False, "math"), (True, "per-sample")])
def test_micro_batches_never_wait_for_the_device(tiny_model_dir, lora, path, monkeypatch):
    """A step's micro-batches read nothing back from the device: on PyTorch's meta device, where any such read
    (.item(), .tolist(), int(mask.sum()), a boolean index) raises, padding-free micro-batches with a shared prefix
    run forward and backward and return their loss unread. Counts, trained positions and the attention layout come
    from the batch as collated, on the host; the step reads its sums once (Stepper._read)."""
    _force_attention_path(monkeypatch, path)
    model = _model(tiny_model_dir, lora)
    model.set_optimizer("AdamW", lr=1e-2, gradient_accumulation_steps=2)
    rows = [{"messages": [{"role": "system", "content": "You are Twinkle."}] + row["messages"][-2:]} for row in ROWS]
    model.model.to("meta")
    model.device = torch.device("meta")
    assert model._batch(rows[:2])["prefix_spans"][1, 1] > 0  # the system prompt is held once
    for part in (rows[:2], rows[2:]):
        loss = model.forward_backward(part)
        assert loss.device.type == "meta" and loss.shape == ()
    assert all(p.grad is not None and p.grad.device.type == "meta" for p in model.trainable_parameters())
    with pytest.raises((RuntimeError, NotImplementedError), match="meta"):  # the step's read
        model.clip_grad_and_step(1.0)
    # The check catches a read: with the layout moved to the device, the attention would have to read it back.
    monkeypatch.setattr(device_batch, "HOST_KEYS", ())
    with pytest.raises((RuntimeError, NotImplementedError), match="meta"):
        model.forward_backward(rows[:2])


def test_the_shared_prefix_stops_before_any_trained_token():
    """A prefix is shared only while no label in it, nor the one after it, is a target, and each sample keeps a
    token of its own; packed examples and single ones share nothing."""
    def row(ids, trained_from):
        return {"input_ids": ids, "labels": [-100] * trained_from + ids[trained_from:]}

    assert shared_prefix_length([row([1, 2, 3, 4, 5], 4), row([1, 2, 3, 9, 9], 4)]) == 3
    assert shared_prefix_length([row([1, 2, 3, 4, 5], 2), row([1, 2, 3, 4, 6], 4)]) == 1  # label 2 is a target
    assert shared_prefix_length([row([1, 2, 3], 3), row([1, 2, 3, 4], 4)]) == 2  # the first keeps one token
    assert shared_prefix_length([row([1, 2, 3], 1), row([1, 2, 3], 1)]) == 0
    assert shared_prefix_length([row([7, 2], 2), row([1, 2], 2)]) == 0
    assert shared_prefix_length([row([1, 2, 3], 3)]) == 0
    packed = [{**row([1, 2, 3], 3), "position_ids": [0, 1, 0]}, {**row([1, 2, 3], 3), "position_ids": [0, 1, 2]}]
    assert shared_prefix_length(packed) == 0
    batch = collate_padding_free([row([1, 2, 3, 4, 5], 4), row([1, 2, 3, 9, 8], 4)])
    assert batch["input_ids"].tolist() == [[1, 2, 3, 4, 5, 9, 8]]
    assert batch["labels"].tolist() == [[-100, -100, -100, -100, 5, -100, 8]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 4, 3, 4]]
    assert batch["cu_seq_lens_q"].tolist() == [0, 5, 7]


def test_padding_free_packed_sequences_equal_the_block_mask(tiny_model_dir):
    """Packed examples (position ids restarting) laid end to end give the loss of their 4-D block-causal mask."""
    model = _model(tiny_model_dir)
    examples = _examples(model)
    packed = pack_examples(examples, max_length=2 * max(len(e["input_ids"]) for e in examples))
    assert len(packed) >= 2 and any(list(p["position_ids"]).count(0) > 1 for p in packed)
    masked = model.forward_only(collate(packed, pad_token_id=model.tokenizer.pad_token_id))
    assert model.forward_only(collate_padding_free(packed)) == pytest.approx(masked, rel=1e-6)


def test_math_attention_and_sdpa_give_the_same_logits_and_generation(tiny_model_dir):
    """twinkle_sdpa's math path (short CPU sequences) against Transformers' SDPA: padded training batches and
    left-padded batched generation (GRPO's rollouts) alike."""
    model = _model(tiny_model_dir, lora=False)
    hf = model.model
    assert hf.config._attn_implementation == "twinkle_sdpa"
    batch = collate(_examples(model), pad_token_id=model.tokenizer.pad_token_id)
    real = batch["attention_mask"].bool()
    with torch.no_grad():
        ours = hf(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        hf.set_attn_implementation("sdpa")
        theirs = hf(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        prompts = model.tokenizer(["hello there", "Who made you? Tell me"], return_tensors="pt", padding=True,
                                  padding_side="left")
        expected = hf.generate(**prompts, max_new_tokens=6, do_sample=False)
        hf.set_attn_implementation("twinkle_sdpa")
        generated = hf.generate(**prompts, max_new_tokens=6, do_sample=False)
    assert torch.allclose(ours[real], theirs[real], atol=1e-5)
    assert torch.equal(generated, expected)


class _LargestTensor(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(tensor, torch.Tensor) and tensor.dtype == torch.float32:
                self.largest = max(self.largest, tensor.numel())
        return out


def test_chunked_output_layer_loss_equals_cross_entropy_without_a_full_logits_tensor():
    torch.manual_seed(0)
    tokens, hidden_size, vocab = 300, 16, 1000
    hidden = torch.randn(tokens, hidden_size, requires_grad=True)
    weight = torch.randn(vocab, hidden_size, requires_grad=True)
    targets = torch.randint(0, vocab, (tokens,))
    reference = F.cross_entropy(F.linear(hidden, weight), targets, reduction="sum")
    ref_grads = torch.autograd.grad(3 * reference, (hidden, weight))
    with _LargestTensor() as probe:
        loss = linear_cross_entropy_sum(hidden, weight, targets, chunk_elements=64 * vocab)
        grads = torch.autograd.grad(3 * loss, (hidden, weight))
    assert float(loss) == pytest.approx(float(reference), rel=1e-6)
    for ours, theirs in zip(grads, ref_grads):
        assert torch.allclose(ours, theirs, rtol=1e-5, atol=1e-5)
    assert probe.largest < tokens * vocab  # chunks of 64 rows: no [tokens, vocab] fp32 tensor at any time
    with torch.no_grad():
        assert float(linear_cross_entropy_sum(hidden, weight, targets)) == pytest.approx(float(reference), rel=1e-6)


def test_sliding_window_models_keep_padded_batches(tmp_path):
    path = save_tiny_model(tmp_path / "mistral", "mistral", sliding_window=8)
    model = TransformersModel(str(path), mixed_precision="no")
    assert not model.padding_free
    assert model.model.config._attn_implementation == "sdpa"


def test_saved_checkpoint_names_no_private_attention(tiny_model_dir, tmp_path):
    model = _model(tiny_model_dir, lora=False)
    saved = model.save("model", tmp_path)
    assert "twinkle_sdpa" not in json.dumps(json.loads((saved / "config.json").read_text()))


def test_length_grouped_order_sees_every_row_once_per_epoch_with_less_padding():
    lengths = [(i * 37) % 500 + 1 for i in range(1000)]
    rows = [{"input_ids": [0] * n} for n in lengths]

    def epoch(group, seed=3, skip=0):
        batches = local_micro_batches(rows, 8, seed, 0, 1, skip=skip, group_by_length=group)
        return [[len(r["input_ids"]) for r in next(batches)] for _ in range(125 - skip)]

    grouped, plain = epoch(True), epoch(False)
    assert sorted(n for b in grouped for n in b) == sorted(lengths)

    def padding(batches):
        return sum(max(b) * len(b) - sum(b) for b in batches)

    assert padding(grouped) < 0.1 * padding(plain)
    assert epoch(True) == grouped and epoch(True, seed=4) != grouped
    assert epoch(True, skip=10) == grouped[10:]  # a resume skips exactly the trained micro-batches


def test_compiled_decoder_layers_train_like_eager_ones(tiny_model_dir):
    """--compile: each decoder layer compiled (dynamic shapes), the same losses in fp32 on padding-free batches
    of two shapes (one graph serves both); a multi-process model refuses it."""
    from twinkle_core.models.compiled import decoder_layers

    eager, compiled = _model(tiny_model_dir), _model(tiny_model_dir, compile=True)
    layers = decoder_layers(compiled.model)
    assert layers and all(layer._compiled_call_impl is not None for layer in layers)
    examples = _examples(eager)
    for batch in (collate_padding_free(examples), collate_padding_free(examples[:2])):
        reference, losses = _train(eager, batch, steps=2), _train(compiled, batch, steps=2)
        assert losses == pytest.approx(reference, rel=1e-5)
    assert losses[-1] < losses[0]


def test_compile_is_refused_where_it_is_not_built(tiny_model_dir, tmp_path):
    from flows.sft import SFTConfig
    from twinkle_core.train.checks import run_problems

    (tmp_path / "rows.jsonl").write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}\n')
    common = dict(model_id=str(tiny_model_dir), dataset=str(tmp_path / "rows.jsonl"), compile=True)
    assert not [p for p in run_problems(SFTConfig(**common)) if "compile" in p]
    with pytest.raises(ValueError, match="compile=True: compiled decoder layers are built and measured for one "
                                         "process; use compile=false"):
        SFTConfig(**common, nproc_per_node=2, dp_size=2)
    with pytest.raises(ValueError, match="backend='megatron': compile=True: compiled decoder layers belong to the "
                                         "Transformers backend"):
        SFTConfig(**common, backend="megatron")
