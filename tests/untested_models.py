"""Tiny models of architectures outside the tested families, as Transformers builds them.

Each is its architecture's real layer kinds, shrunk (2 layers, hidden 32), with a tokenizer that ships its
own chat template (ChatML), as instruct checkpoints do, or none (`chat_template=None`).

    path = save_untested_model("gemma2", tmp_path / "org" / "tiny-gemma2")
"""
from __future__ import annotations

import json
from pathlib import Path

from tiny_models import CHATML_TEMPLATE, make_tiny_causal_lm, save_tiny_model

# model_type → what its tiny config sets beyond make_tiny_causal_lm's shapes.
UNTESTED: dict[str, dict] = {
    # soft-capped attention and logits, sandwich norms, a sliding window every other layer
    "gemma2": dict(head_dim=8, hidden_activation="gelu_pytorch_tanh", sliding_window=16),
    "phi3": dict(),  # fused qkv_proj and gate_up_proj
    "gpt2": dict(),  # learned positions, LayerNorm, GELU, Conv1D projections
    "olmo2": dict(),  # RMSNorm after attention and MLP, q/k norms over the whole projection
    # Qwen2-MoE: qkv bias, softmax top-k experts plus a sigmoid-gated shared expert (megatron expresses it)
    "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                      shared_expert_intermediate_size=32),
}


def save_untested_model(model_type: str, directory: str | Path, chat_template: str | None = CHATML_TEMPLATE) -> Path:
    directory = Path(directory)
    model, tokenizer = make_tiny_causal_lm(model_type, **UNTESTED[model_type])
    tokenizer.chat_template = chat_template
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


CONFIG_CODE = '''from transformers import LlamaConfig


class TinyRemoteConfig(LlamaConfig):
    model_type = "tiny_remote"
'''
MODEL_CODE = '''from transformers import LlamaForCausalLM

from .configuration_tiny_remote import TinyRemoteConfig


class TinyRemoteForCausalLM(LlamaForCausalLM):
    config_class = TinyRemoteConfig
'''


def save_remote_code_model(directory: Path) -> Path:
    """A Llama whose config names a model_type transformers lacks, with the code for it (as custom repos do)."""
    save_tiny_model(directory, "llama")
    (directory / "configuration_tiny_remote.py").write_text(CONFIG_CODE)
    (directory / "modeling_tiny_remote.py").write_text(MODEL_CODE)
    config = json.loads((directory / "config.json").read_text())
    config.update(model_type="tiny_remote", architectures=["TinyRemoteForCausalLM"], auto_map={
        "AutoConfig": "configuration_tiny_remote.TinyRemoteConfig",
        "AutoModelForCausalLM": "modeling_tiny_remote.TinyRemoteForCausalLM"})
    (directory / "config.json").write_text(json.dumps(config))
    return directory
