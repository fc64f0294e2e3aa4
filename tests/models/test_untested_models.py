"""Untested families on the Transformers backend: what the model declares decides, and remote code runs only
when asked. A checkpoint whose architecture ships as code beside its weights is refused with the reason and
the option; with trust_remote_code=True its code loads, and it trains."""
import pytest
import torch
from peft import LoraConfig

from tiny_models import SAMPLE_ROWS
from untested_models import save_remote_code_model, save_untested_model
from twinkle_core.families import UnsupportedModelError, family_for_model_dir
from twinkle_core.models import TransformersModel


def test_remote_code_is_refused_unless_trusted_and_then_trains(tmp_path):
    path = save_remote_code_model(tmp_path / "org" / "tiny-remote")
    with pytest.raises(UnsupportedModelError, match=r"model_type 'tiny_remote' is not built into transformers.*"
                                                    r"modeling_tiny_remote.*--trust-remote-code"):
        TransformersModel(str(path), mixed_precision="no")
    model = TransformersModel(str(path), mixed_precision="no", trust_remote_code=True)
    assert type(model.model).__name__ == "TinyRemoteForCausalLM" and model.family.name == "untested-tiny_remote"
    model.add_adapter_to_model("default", LoraConfig(r=8, lora_alpha=16))
    model.set_optimizer("AdamW", lr=2e-2)
    losses = []
    for _ in range(6):
        model.forward_backward(inputs=SAMPLE_ROWS)
        model.clip_grad_and_step(max_grad_norm=1.0)
        losses.append(model.calculate_metric()["loss"])
    assert losses[-1] < losses[0], losses


def test_untested_family_capabilities_come_from_the_model(tmp_path):
    path = save_untested_model("olmo2", tmp_path / "org" / "tiny-olmo2")
    family = family_for_model_dir(path)
    assert (family.name, family.tested, family.chat_template) == ("untested-olmo2", False, None)
    model = TransformersModel(str(path), mixed_precision="no")
    model.add_adapter_to_model("default", LoraConfig(r=4, lora_alpha=8))  # all-linear: every projection
    adapted = {name.split(".")[-1] for name, module in model.model.named_modules() if hasattr(module, "lora_A")}
    assert adapted == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    # The tokenizer's own template renders the chats (no family template to fall back on).
    assert model.tokenizer.chat_template.startswith("{% for message in messages %}")
    assert torch.isfinite(torch.tensor(model.forward_only(SAMPLE_ROWS)))


def test_untested_layouts_are_decided_by_the_model_config(tmp_path):
    from transformers import AutoConfig

    from twinkle_core.parallel import ParallelConfig, check_parallel_config

    configs = {t: AutoConfig.from_pretrained(save_untested_model(t, tmp_path / t)) for t in ("olmo2", "gpt2", "gemma2")}
    tp2, sp2 = ParallelConfig(nproc_per_node=2, tp_size=2), ParallelConfig(nproc_per_node=2, sp_size=2)
    assert check_parallel_config(tp2, configs["olmo2"])["tp_size"] == 2  # its base_model_tp_plan
    assert check_parallel_config(sp2, configs["olmo2"])["sp_size"] == 2  # softmax attention, no window
    with pytest.raises(ValueError, match=r"tp_size=2: model_type 'gpt2' has no tensor-parallel plan"):
        check_parallel_config(tp2, configs["gpt2"])
    with pytest.raises(ValueError, match=r"sp_size=2: model_type 'gemma2' .*sliding"):
        check_parallel_config(sp2, configs["gemma2"])
