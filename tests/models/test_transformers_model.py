"""TransformersModel on a tiny real Llama: exact accumulation, loss goes down, save/load round trips."""
import pytest
import torch
from peft import LoraConfig

from tiny_models import SAMPLE_ROWS as ROWS
from twinkle_core.data import collate, encode_chat
from twinkle_core.models import TransformersModel
from twinkle_core.objectives.causal_lm import causal_lm_loss_sum


def _model(path, lora: bool, precision: str = "no", lr: float = 1e-2, accumulation: int = 1, seed: int = 0):
    torch.manual_seed(seed)
    model = TransformersModel(str(path), mixed_precision=precision)
    if lora:
        model.add_adapter_to_model("default", LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"),
                                   gradient_accumulation_steps=accumulation)
    model.set_optimizer("AdamW", lr=lr, gradient_accumulation_steps=accumulation)
    return model


def _batch(model, rows):
    return collate([encode_chat(model.tokenizer, r["messages"]) for r in rows], pad_token_id=model.tokenizer.pad_token_id)


def _tensors(model, rows):
    """An encoded batch on the model's device (the tests also run on CUDA)."""
    return {k: torch.as_tensor(v).to(model.device) for k, v in _batch(model, rows).items()}


def test_loss_on_trained_positions_equals_full_cross_entropy(tiny_model_dir):
    model = TransformersModel(str(tiny_model_dir), mixed_precision="no")
    batch = _tensors(model, ROWS)
    loss_sum, tokens = causal_lm_loss_sum(model.model, batch)
    reference = model.model(**batch).loss  # HF's mean over trained tokens, full-vocabulary logits everywhere
    assert tokens == int((batch["labels"][:, 1:] != -100).sum())
    assert torch.allclose(loss_sum / tokens, reference, atol=1e-6)


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_gradient_accumulation_is_exact(tiny_model_dir, lora):
    """Two micro-batches of 2 rows with accumulation == one batch of the same 4 rows (fp32, 1e-5)."""
    whole = _model(tiny_model_dir, lora)
    split = _model(tiny_model_dir, lora, accumulation=2)
    whole.forward_backward(inputs=_batch(whole, ROWS))
    assert whole.clip_grad_and_step(max_grad_norm=None)
    split.forward_backward(inputs=_batch(split, ROWS[:2]))
    assert not split.clip_grad_and_step(max_grad_norm=None)  # still accumulating
    split.forward_backward(inputs=_batch(split, ROWS[2:]))
    assert split.clip_grad_and_step(max_grad_norm=None)
    a, b = whole.calculate_metric(), split.calculate_metric()
    assert abs(a["loss"] - b["loss"]) < 1e-5
    assert abs(a["grad_norm"] - b["grad_norm"]) < 1e-5 * max(1.0, a["grad_norm"])
    for (name, p), (_, q) in zip(whole.model.named_parameters(), split.model.named_parameters()):
        assert torch.allclose(p, q, atol=1e-5), name


@pytest.mark.parametrize("lora,precision", [(True, "no"), (False, "no"), (True, "bf16")],
                         ids=["lora-fp32", "full-fp32", "lora-bf16"])
def test_training_makes_the_loss_go_down(tiny_model_dir, lora, precision):
    model = _model(tiny_model_dir, lora, precision, lr=1e-2 if lora else 5e-3)
    losses = []
    for _ in range(30):
        model.forward_backward(inputs=ROWS)  # chat rows, encoded with the model's template
        model.clip_grad_and_step(max_grad_norm=1.0)
        losses.append(model.calculate_metric()["loss"])
    assert all(torch.isfinite(torch.tensor(losses)))
    # A random tiny model starts near uniform (ln 384 = 5.95); full training halves the loss, LoRA (a
    # rank-4 update of frozen random weights) lowers it by over half a nat in 30 steps.
    if lora:
        assert losses[-1] < losses[0] - 0.4, losses
    else:
        assert losses[-1] < 0.5 * losses[0], losses


def test_bf16_stores_frozen_weights_in_bf16_and_trains_fp32_masters(tiny_model_dir):
    model = _model(tiny_model_dir, lora=True, precision="bf16")
    dtypes = {(p.requires_grad, p.dtype) for p in model.model.parameters()}
    assert dtypes == {(True, torch.float32), (False, torch.bfloat16)}


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_save_then_load_gives_identical_logits(tiny_model_dir, tmp_path, lora):
    model = _model(tiny_model_dir, lora, lr=5e-2)
    for _ in range(3):
        model.forward_backward(inputs=ROWS)
        model.clip_grad_and_step()
    name = "default" if lora else "model"
    saved = model.save(name, tmp_path / "out")
    assert (saved / ("adapter_config.json" if lora else "config.json")).exists()
    batch = _tensors(model, ROWS)
    model.model.eval()
    with torch.no_grad():
        expected = model.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    fresh = TransformersModel(str(tiny_model_dir), mixed_precision="no")
    fresh.load(name, tmp_path / "out")
    fresh.model.eval()
    with torch.no_grad():
        got = fresh.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    assert torch.equal(got, expected) or torch.allclose(got, expected, atol=1e-6)
    base = TransformersModel(str(tiny_model_dir), mixed_precision="no").model.eval().to(model.device)
    with torch.no_grad():
        untrained = base(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    assert not torch.allclose(untrained, expected, atol=1e-3)  # training did change the model


def test_saved_adapter_loads_with_plain_peft(tiny_model_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = _model(tiny_model_dir, lora=True, lr=5e-2)
    model.forward_backward(inputs=ROWS)
    model.clip_grad_and_step()
    saved = model.save("tenant", tmp_path)
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), saved)
    peft_model.to(model.device)
    batch = _tensors(model, ROWS[:1])
    model.model.eval()
    with torch.no_grad():
        ours = model.model(input_ids=batch["input_ids"]).logits
        theirs = peft_model(input_ids=batch["input_ids"]).logits
    assert torch.allclose(ours, theirs, atol=1e-6)


def test_generate_returns_text(tiny_model_dir):
    model = TransformersModel(str(tiny_model_dir), mixed_precision="no")
    answer = model.generate([{"role": "user", "content": "Who are you?"}], max_new_tokens=5)
    assert isinstance(answer, str)


@pytest.mark.parametrize("kwargs,words", [
    ({"mixed_precision": "fp8"}, ["fp8", "Transformer Engine", "bf16"]),
    ({"mixed_precision": "fp64"}, ["fp64", "bf16", "no"]),
    ({"strategy": "deepspeed"}, ["deepspeed", "accelerate", "native_fsdp"]),
])
def test_unsupported_settings_fail_before_loading(tiny_model_dir, kwargs, words):
    with pytest.raises(ValueError) as err:
        TransformersModel(str(tiny_model_dir), **kwargs)
    for word in words:
        assert word in str(err.value)


def test_a_world_size_without_torchrun_says_how_to_launch(tiny_model_dir, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    with pytest.raises(RuntimeError, match="WORLD_SIZE=2.*torchrun"):
        TransformersModel(str(tiny_model_dir))


def test_verbs_in_the_wrong_order_say_what_to_call(tiny_model_dir):
    model = TransformersModel(str(tiny_model_dir), mixed_precision="no")
    with pytest.raises(RuntimeError, match="set_optimizer"):
        model.forward_backward(inputs=ROWS)


def test_pickle_only_weights_are_refused_unless_allowed_then_read_safely(tiny_model_dir, tmp_path, caplog):
    """A folder with only pytorch_model.bin is refused, naming the option; allowed, it loads (with
    torch.load(weights_only=True)) the same weights as the safetensors folder, and says so in the log."""
    import shutil

    from transformers import AutoModelForCausalLM

    from twinkle_core.hub import HubError

    pickled = tmp_path / "pickled"
    shutil.copytree(tiny_model_dir, pickled, ignore=shutil.ignore_patterns("*.safetensors*"))
    torch.save(AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict(), pickled / "pytorch_model.bin")
    assert (pickled / "pytorch_model.bin").is_file() and not list(pickled.glob("*.safetensors"))
    with pytest.raises(HubError, match="only as pickle files.*--allow-pickle-weights"):
        TransformersModel(str(pickled), mixed_precision="no")
    with caplog.at_level("WARNING"):
        allowed = TransformersModel(str(pickled), mixed_precision="no", allow_pickle_weights=True)
    assert "loading pickle weights" in caplog.text
    safe = TransformersModel(str(tiny_model_dir), mixed_precision="no")
    ids = torch.tensor([[1, 5, 9, 4]])
    with torch.no_grad():
        assert torch.equal(allowed.model(input_ids=ids).logits, safe.model(input_ids=ids).logits)
