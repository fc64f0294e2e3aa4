"""Every model family trains on CPU: LoRA and full fine-tuning lower the loss, adapters round-trip, MoE
routers report their load-balancing loss and it enters the objective with its coefficient."""
import json

import pytest
import torch
from peft import LoraConfig
from safetensors import safe_open

from family_models import (FAMILY_VARIANTS, TOKENS, pack_internlm2_wqkv, save_tiny_family_model,
                           tiny_internlm2_reference)
from tiny_models import CHATML_TEMPLATE, SAMPLE_ROWS as ROWS
from twinkle_core.data import get_chat_template
from twinkle_core.families import get_family
from twinkle_core.models import TransformersModel
from twinkle_core.models.batches import to_batch
from twinkle_core.objectives.causal_lm import causal_lm_loss_sum

CASES = [(family, variant) for family, variants in FAMILY_VARIANTS.items() for variant in variants]
IDS = [f"{family}-{variant}" for family, variant in CASES]

MODEL_TYPES = {
    ("qwen3_5", "dense"): "qwen3_5", ("qwen3_5", "moe"): "qwen3_5_moe", ("qwen2_5", "dense"): "qwen2",
    ("qwen3", "dense"): "qwen3", ("qwen3", "moe"): "qwen3_moe",
    ("llama3", "dense"): "llama", ("mistral", "dense"): "mistral", ("yi", "dense"): "llama",
    ("glm4", "dense"): "glm4", ("deepseek_r1", "moe"): "deepseek_v3", ("deepseek_v4", "moe"): "deepseek_v4",
    ("internlm2_5", "dense"): "internlm2",
}
# MoE families whose Transformers module defines a router load-balancing loss (DeepSeek-V3 balances by a bias).
ROUTER_LOSS = {("qwen3_5", "moe"), ("qwen3", "moe"), ("deepseek_v4", "moe")}
# DeepSeek-V4's grouped output projection `o_a_proj` is an nn.Linear subclass with a block-diagonal forward:
# PEFT wraps it as a plain Linear and the LoRA delta has the wrong shape (16 vs 32 at the group axis).
LORA_EXCLUDE = {"deepseek_v4": ["o_a_proj"]}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """Each family checkpoint, written once, with a ChatML template (the family templates live elsewhere)."""
    root = tmp_path_factory.mktemp("families")
    return {(f, v): save_tiny_family_model(f, root / f"{f}-{v}", v, tokenizer_chat_template=CHATML_TEMPLATE)
            for f, v in CASES}


def _model(path, lora_family: str | None = None, lr: float = 1e-2, **kwargs) -> TransformersModel:
    torch.manual_seed(0)
    model = TransformersModel(str(path), mixed_precision="no", **kwargs)
    if lora_family is not None:
        model.add_adapter_to_model("default", LoraConfig(
            r=8, lora_alpha=16, target_modules="all-linear", exclude_modules=LORA_EXCLUDE.get(lora_family)))
    model.set_optimizer("AdamW", lr=lr)
    return model


def _train(model: TransformersModel, steps: int) -> list[dict]:
    metrics = []
    for _ in range(steps):
        model.forward_backward(inputs=ROWS)
        assert model.clip_grad_and_step(max_grad_norm=1.0)
        metrics.append(model.calculate_metric())
    return metrics


def _tensors(model: TransformersModel) -> dict[str, torch.Tensor]:
    return to_batch(ROWS, model.tokenizer, model.device, max_length=None)


@torch.no_grad()
def _logits(model: TransformersModel, batch: dict) -> torch.Tensor:
    model.model.eval()
    return model.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits


@pytest.mark.parametrize("family,variant", CASES, ids=IDS)
def test_checkpoint_has_the_family_layout(tmp_path, family, variant):
    path = save_tiny_family_model(family, tmp_path / "model", variant)
    assert json.loads((path / "config.json").read_text())["model_type"] == MODEL_TYPES[family, variant]
    model = TransformersModel(str(path), mixed_precision="no", family=family)
    # The tiny tokenizers ship no template, as some checkpoints do: the family registry supplies it.
    assert model.tokenizer.chat_template == get_chat_template(get_family(family).chat_template)
    assert set(TOKENS[family].special) <= set(model.tokenizer.get_vocab())
    stops = json.loads((path / "generation_config.json").read_text())["eos_token_id"]
    assert model.tokenizer.eos_token_id in stops
    assert sum(p.numel() for p in model.model.parameters()) < 200_000


def test_internlm2_checkpoint_is_in_its_own_format_and_converts_to_its_reference(model_dirs, tmp_path):
    path = model_dirs["internlm2_5", "dense"]
    config = json.loads((path / "config.json").read_text())
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_internlm2.InternLM2ForCausalLM"
    reference = TransformersModel(str(tiny_internlm2_reference(tmp_path / "llama")), mixed_precision="no")
    layer = reference.model.model.layers[0].self_attn
    with safe_open(path / "model.safetensors", framework="pt") as stored:
        assert {"model.tok_embeddings.weight", "output.weight", "model.layers.0.feed_forward.w1.weight"} <= set(
            stored.keys())
        wqkv = stored.get_tensor("model.layers.0.attention.wqkv.weight")
    # InternLM2's attention: view(num_kv_heads, groups + 2, head_dim); q = [:-2], k = [-2], v = [-1].
    kv_heads, head_dim = config["num_key_value_heads"], config["hidden_size"] // config["num_attention_heads"]
    grouped = wqkv.view(kv_heads, -1, head_dim, config["hidden_size"])
    assert torch.equal(grouped[:, :-2].reshape(-1, config["hidden_size"]), layer.q_proj.weight)
    assert torch.equal(grouped[:, -2].reshape(-1, config["hidden_size"]), layer.k_proj.weight)
    assert torch.equal(grouped[:, -1].reshape(-1, config["hidden_size"]), layer.v_proj.weight)
    assert torch.equal(pack_internlm2_wqkv(layer.q_proj.weight, layer.k_proj.weight, layer.v_proj.weight, kv_heads),
                       wqkv)
    converted = TransformersModel(str(path), mixed_precision="no")  # the hub converts it to a Llama checkpoint
    batch = _tensors(reference)
    assert torch.allclose(_logits(converted, batch), _logits(reference, batch), atol=1e-5)


@pytest.mark.parametrize("family,variant", CASES, ids=IDS)
def test_lora_training_lowers_the_loss_and_the_adapter_round_trips(model_dirs, tmp_path, family, variant):
    path = model_dirs[family, variant]
    model = _model(path, lora_family=family)
    batch = _tensors(model)
    # The loss on trained positions only equals Transformers' own cross-entropy for this architecture.
    parts = causal_lm_loss_sum(model.model, batch, router_aux_loss_coef=0.0)
    with torch.no_grad():
        reference = model.model(**batch).loss
    assert torch.allclose(parts.loss_sum / parts.num_tokens, reference, atol=1e-5)
    metrics = _train(model, 20)
    losses = [m["loss"] for m in metrics]
    assert all(torch.isfinite(torch.tensor(losses))), losses
    assert losses[-1] < losses[0] - 0.5, losses
    assert ("aux_loss" in metrics[-1]) == ((family, variant) in ROUTER_LOSS)
    model.save("default", tmp_path / "out")
    expected = _logits(model, batch)
    fresh = TransformersModel(str(path), mixed_precision="no")
    fresh.load("default", tmp_path / "out")
    assert torch.allclose(_logits(fresh, batch), expected, atol=1e-6)


@pytest.mark.parametrize("family,variant", [("qwen2_5", "dense"), ("qwen3", "moe"), ("qwen3_5", "moe"),
                                            ("deepseek_r1", "moe"), ("deepseek_v4", "moe")],
                         ids=["qwen2_5", "qwen3-moe", "qwen3_5-moe", "deepseek_r1", "deepseek_v4"])
def test_full_training_lowers_the_loss(model_dirs, family, variant):
    model = _model(model_dirs[family, variant], lr=5e-3)
    losses = [m["loss"] for m in _train(model, 20)]
    assert losses[-1] < 0.6 * losses[0], losses


@pytest.mark.parametrize("family,variant", sorted(ROUTER_LOSS), ids=[f"{f}-{v}" for f, v in sorted(ROUTER_LOSS)])
def test_router_aux_loss_enters_the_loss_as_coefficient_times_aux(model_dirs, family, variant):
    path = model_dirs[family, variant]
    default = _model(path)
    config = json.loads((path / "config.json").read_text())
    assert default.router_aux_loss_coef == config.get("text_config", config)["router_aux_loss_coef"]
    batch = _tensors(default)
    with torch.no_grad():
        plain = causal_lm_loss_sum(default.model, batch, router_aux_loss_coef=0.0)
        weighted = causal_lm_loss_sum(default.model, batch, router_aux_loss_coef=0.5)
        theirs = default.model(**batch, output_router_logits=True).aux_loss
    assert plain.aux_loss is None
    assert torch.allclose(weighted.aux_loss, theirs)  # the architecture's own load_balancing_loss_func
    assert torch.allclose(weighted.loss_sum - plain.loss_sum, 0.5 * weighted.aux_loss * weighted.num_tokens)
    # Through the training verbs: same weights and batch, coefficient 0 vs 0.5.
    off, on = _model(path, router_aux_loss_coef=0.0), _model(path, router_aux_loss_coef=0.5)
    (m_off,), (m_on,) = _train(off, 1), _train(on, 1)
    assert "aux_loss" not in m_off and m_on["aux_loss"] > 0
    assert abs((m_on["loss"] - m_off["loss"]) - 0.5 * m_on["aux_loss"]) < 1e-5
    # Held-out loss and perplexity are cross-entropy only.
    assert default.forward_only(batch) == pytest.approx(float(plain.loss_sum) / plain.num_tokens, abs=1e-6)


@pytest.mark.parametrize("family,variant,words", [
    ("deepseek_r1", "moe", ["deepseek_v3", "routing bias", "None or 0"]),
    ("llama3", "dense", ["llama", "None or 0"]),
], ids=["deepseek_r1", "llama3"])
def test_a_coefficient_for_a_model_without_router_loss_is_rejected(model_dirs, family, variant, words):
    with pytest.raises(ValueError) as err:
        TransformersModel(str(model_dirs[family, variant]), mixed_precision="no", router_aux_loss_coef=0.01)
    for word in words:
        assert word in str(err.value)
