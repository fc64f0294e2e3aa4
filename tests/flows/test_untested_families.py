"""Models outside the tested families: any causal LM Transformers can load trains through the sft flow.

The proof matrix of the README's "Other models": a tiny model of each architecture (its real layer kinds,
shrunk), with a tokenizer that ships its own chat template, goes through the sft flow with LoRA; the loss
falls, the held-out loss improves, the saved adapter reloads to the loss the flow recorded, the run says the
family is untested, and megatron-core refuses what its table cannot express, naming what does not fit (Qwen2-MoE
it expresses).
A model with no chat template fails before training, naming --chat-template; the option takes one of our
templates or a Jinja file.
"""
import time

import pytest
from mlflow import MlflowClient
from transformers import AutoTokenizer

from flows.sft import SFTConfig, sft
from untested_models import UNTESTED, save_remote_code_model, save_untested_model
from twinkle_core.convert import NotMegatronCapableError, megatron_family
from twinkle_core.data import get_chat_template, load_tokenized
from twinkle_core.families import UnsupportedModelError, get_family
from twinkle_core.tracking import tracking_uri
from twinkle_core.train.checks import RunConfigError
from test_families_sft import _probe_loss

# What megatron-core's table cannot express in each, as the refusal names it.
MEGATRON_REFUSAL = {
    "gemma2": "attn_logit_softcapping",
    "phi3": "original_max_position_embeddings",
    "gpt2": "activation_function",
    "olmo2": "post_feedforward_layernorm",
    "qwen2_moe": None,  # expressed: its bridge round trip is in tests/convert/test_bridge_layouts.py
}


def _config(ws, model_dir, **overrides) -> SFTConfig:
    settings = dict(model_id=str(model_dir), dataset=str(ws["train"]), eval_dataset=str(ws["heldout"]),
                    mixed_precision="no", use_lora=True, max_steps=12, batch_size=4, lr=2e-2, max_length=192,
                    eval_prompts=1, max_new_tokens=4, output_dir=str(ws["root"] / "runs"))
    return SFTConfig(**{**settings, **overrides})


@pytest.mark.parametrize("model_type", sorted(UNTESTED))
def test_untested_architecture_trains_through_the_sft_flow(sft_workspace, model_type):
    ws = sft_workspace
    model_dir = save_untested_model(model_type, ws["root"] / "org" / f"tiny-{model_type}")
    config = _config(ws, model_dir, registered_model_name=f"tiny-{model_type}")
    result = sft(config)
    assert result["family"] == f"untested-{model_type}"
    assert not get_family(result["family"]).tested
    assert f"family: untested (model_type '{model_type}'" in result["summary"]
    client = MlflowClient(tracking_uri())
    losses = [m.value for m in sorted(client.get_metric_history(result["run_id"], "loss"), key=lambda m: m.step)]
    assert len(losses) == config.max_steps and min(losses[-3:]) < losses[0], losses
    assert result["reports"]["trained"]["eval_loss"] < result["reports"]["base"]["eval_loss"]
    assert _probe_loss(model_dir, result, config.batch_size) == pytest.approx(result["probe_loss"], abs=1e-5)
    if MEGATRON_REFUSAL[model_type] is None:
        assert megatron_family(model_dir) == f"untested-{model_type}"
        return
    with pytest.raises(NotMegatronCapableError, match=MEGATRON_REFUSAL[model_type]):
        megatron_family(model_dir)


def test_megatron_refuses_an_untested_architecture_before_anything_runs(sft_workspace):
    ws = sft_workspace
    model_dir = save_untested_model("olmo2", ws["root"] / "org" / "tiny-olmo2")
    with pytest.raises(RunConfigError, match=r"backend='megatron': .*post_feedforward_layernorm"):
        sft(_config(ws, model_dir, backend="megatron", mixed_precision="no"))
    assert not (ws["root"] / "cache" / "tokenized").exists()  # failed before tokenizing


def test_remote_code_fails_at_download_naming_the_option_without_retrying(sft_workspace):
    ws = sft_workspace
    model_dir = save_remote_code_model(ws["root"] / "org" / "tiny-remote")
    started = time.monotonic()
    with pytest.raises(UnsupportedModelError, match=r"ships its own modelling code.*--trust-remote-code"):
        sft(_config(ws, model_dir))
    assert time.monotonic() - started < 8  # no retries (each waits 5 s): the checkpoint, not the hub, is at fault


def test_a_model_without_a_chat_template_names_the_option(sft_workspace, tmp_path):
    ws = sft_workspace
    model_dir = save_untested_model("olmo2", ws["root"] / "org" / "bare-olmo2", chat_template=None)
    with pytest.raises(RunConfigError, match=r"chat_template=None: .*has no chat template.*--chat-template NAME"):
        sft(_config(ws, model_dir))
    with pytest.raises(ValueError, match=r"chat_template='qwen9' is neither one of our templates"):
        _config(ws, model_dir, chat_template="qwen9")

    # A name from our templates, or a Jinja file: the tokenized data is rendered with it.
    jinja = tmp_path / "mine.jinja"
    jinja.write_text(get_chat_template("chatml"))
    for choice in ("chatml", str(jinja)):
        config = _config(ws, model_dir, chat_template=choice)
        assert config.model_options()["chat_template"] == get_chat_template("chatml")
    from tasks.refs import ModelRef
    from twinkle_core.data import tokenize_dataset

    model = ModelRef(model_id=str(model_dir), path=str(model_dir), content_hash="x", family="untested-olmo2",
                     template_source=get_chat_template("chatml"))
    config.check_model(model)  # passes now
    data = tokenize_dataset(ws["train"], model_dir, chat_template=None, chosen_template=model.template_source)
    examples = load_tokenized(data.path)
    assert len(examples) == 16
    assert AutoTokenizer.from_pretrained(model_dir).decode(examples[0]["input_ids"]).startswith("<|im_start|>user\n")


def test_untested_architecture_trains_tenants_through_the_multi_lora_flow(sft_workspace):
    from flows.multi_lora import MultiLoraConfig, TenantSpec, multi_lora

    ws = sft_workspace
    model_dir = save_untested_model("gemma2", ws["root"] / "org" / "tiny-gemma2")
    tenants = [TenantSpec(name=name, dataset=str(ws["train"]), eval_dataset=str(ws["heldout"]), max_steps=6,
                          batch_size=4, lr=2e-2, lora_r=4, lora_alpha=8, seed=seed)
               for name, seed in (("alpha", 0), ("beta", 1))]
    result = multi_lora(MultiLoraConfig(
        model_id=str(model_dir), mixed_precision="no", max_length=64, eval_prompts=1, max_new_tokens=4,
        registered_model_prefix="untested", output_dir=str(ws["root"] / "runs"), tenants=tenants))
    assert set(result["results"]) == {"alpha", "beta"} and not result["failures"]
    assert "family: untested (model_type 'gemma2'" in result["summary"]
    client = MlflowClient(tracking_uri())
    for name, run_id in result["tenant_runs"].items():
        losses = [m.value for m in sorted(client.get_metric_history(run_id, "loss"), key=lambda m: m.step)]
        assert len(losses) == 6 and losses[-1] < losses[0], (name, losses)
