"""Bad input fails with a message naming the parameter or option: wrong family, wrong shapes, bad layouts.

Runs in this process at tp=1 (a private one-process group, torn down after the module).
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

from family_models import save_tiny_family_model
from twinkle_core.convert import (CheckpointMismatchError, NotMegatronCapableError, from_te_names, load_hf_weights,
                                  mapping_for, megatron_family, to_te_names)
from twinkle_core.megatron import (MegatronParallel, UnsupportedArchitectureError, build_gpt_model,
                                   destroy_megatron_parallel, disable_cpu_device_mode, initialize_megatron_parallel,
                                   transformer_config_from_hf)


@pytest.fixture(scope="module")
def megatron_tp1():
    initialize_megatron_parallel(MegatronParallel())
    yield
    destroy_megatron_parallel()
    dist.destroy_process_group()
    disable_cpu_device_mode()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {family: save_tiny_family_model(family, root / family)
            for family in ("llama3", "qwen2_5", "glm4", "deepseek_r1")}


def test_wrong_family_names_the_missing_tensor(megatron_tp1, tiny, tmp_path):
    """Llama-layout weights (no biases) under a Qwen 2.5 config, which has q/k/v biases: the first is missing."""
    weights = {k: v for k, v in load_file(tiny["qwen2_5"] / "model.safetensors").items() if not k.endswith("bias")}
    save_file(weights, tmp_path / "model.safetensors")
    config = AutoConfig.from_pretrained(tiny["qwen2_5"])
    model = build_gpt_model(config)
    with pytest.raises(CheckpointMismatchError, match=r"no tensor 'model\.layers\.0\.self_attn\.q_proj\.bias'.*"
                                                      r"decoder\.layers\.0\.self_attention\.linear_qkv\.bias"):
        load_hf_weights(model, config, tmp_path)


def test_tensors_without_a_place_are_named(megatron_tp1, tiny):
    """A Qwen 2.5 checkpoint read with a config that has no biases: the unused bias tensors are listed."""
    config = AutoConfig.from_pretrained(tiny["qwen2_5"])
    config.model_type = "llama"  # Llama without attention_bias: same shapes, no q/k/v biases
    model = build_gpt_model(config)
    with pytest.raises(CheckpointMismatchError, match=r"no place for: \['model\.layers\.0\.self_attn\.k_proj\.bias'"):
        load_hf_weights(model, config, tiny["qwen2_5"])


def test_shape_mismatch_names_both_parameters_and_shapes(megatron_tp1, tiny):
    config = AutoConfig.from_pretrained(tiny["llama3"])
    config.intermediate_size = 96
    model = build_gpt_model(config)
    with pytest.raises(CheckpointMismatchError, match=r"'model\.layers\.0\.mlp\.gate_proj\.weight' has shape "
                                                      r"\[224, 64\].*linear_fc1\.weight.*needs \[96, 64\]"):
        load_hf_weights(model, config, tiny["llama3"])


def test_family_without_megatron_support_is_refused_with_its_reason(tiny):
    with pytest.raises(NotMegatronCapableError, match=r"GLM-4.*cannot be converted to megatron-core: .*sandwich"):
        megatron_family(tiny["glm4"])
    assert megatron_family(tiny["qwen2_5"]) == "qwen2_5"


def test_unsupported_model_type_and_layouts_are_refused(tiny):
    glm = AutoConfig.from_pretrained(tiny["glm4"])
    # glm4 is outside the table: its config is checked key by key (its sandwich norms show in its tensor names).
    with pytest.raises(UnsupportedArchitectureError, match=r"glm4: attention_bias=True on a Llama-type model"):
        transformer_config_from_hf(glm)
    llama = AutoConfig.from_pretrained(tiny["llama3"])  # 1 key/value head
    with pytest.raises(UnsupportedArchitectureError, match=r"tp=2 does not divide the 1 key/value heads.*tp in \[1\]"):
        transformer_config_from_hf(llama, MegatronParallel(tp=2))
    with pytest.raises(UnsupportedArchitectureError, match=r"pp=3 does not divide the 2 layers"):
        transformer_config_from_hf(llama, MegatronParallel(pp=3))
    with pytest.raises(UnsupportedArchitectureError, match=r"ep=2 needs a mixture-of-experts model"):
        transformer_config_from_hf(llama, MegatronParallel(ep=2))
    deepseek = AutoConfig.from_pretrained(tiny["deepseek_r1"])
    with pytest.raises(UnsupportedArchitectureError, match=r"ep=3 does not divide the 4 routed experts"):
        transformer_config_from_hf(deepseek, MegatronParallel(ep=3))
    with pytest.raises(UnsupportedArchitectureError, match=r"etp=1 splits routed experts and this model has none"):
        transformer_config_from_hf(llama, MegatronParallel(etp=1))
    with pytest.raises(UnsupportedArchitectureError, match=r"etp=3 does not divide the experts' ffn size 32"):
        transformer_config_from_hf(deepseek, MegatronParallel(etp=3))
    deepseek.norm_topk_prob = False
    with pytest.raises(UnsupportedArchitectureError, match=r"norm_topk_prob=False"):
        transformer_config_from_hf(deepseek)
    # YaRN converts (tests/convert/test_bridge_layouts.py); Phi-3's longrope rescales attention as megatron cannot.
    llama.rope_parameters = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8,
                             "long_factor": [2.0] * 8, "original_max_position_embeddings": 64}
    llama.max_position_embeddings = 4096
    with pytest.raises(UnsupportedArchitectureError, match=r"rope_type='longrope' rescales attention"):
        from twinkle_core.megatron.model_builder import _hf_inverse_frequencies
        _hf_inverse_frequencies(llama)


def test_transformer_engine_names_map_through_the_same_table(megatron_tp1, tiny):
    """TE-spec names (norms fused into the next linear) translate to local names and back, for every rule."""
    config = AutoConfig.from_pretrained(tiny["qwen2_5"])
    model = build_gpt_model(config)
    local = [k for k in model.state_dict() if not k.endswith("_extra_state")]
    te = to_te_names(local, config)
    assert te["decoder.layers.1.input_layernorm.weight"] == "decoder.layers.1.self_attention.linear_qkv.layer_norm_weight"
    assert te["decoder.layers.1.pre_mlp_layernorm.weight"] == "decoder.layers.1.mlp.linear_fc1.layer_norm_weight"
    assert from_te_names(list(te.values()), config) == {v: k for k, v in te.items()}
    covered = {r.megatron for r in mapping_for(config).layer}
    assert {k.split(".", 3)[3] for k in local if k.startswith("decoder.layers.")} == covered


def test_transformer_engine_names_of_mla_and_moe_layers(megatron_tp1, tiny):
    """MLA fuses its latent norms into the up-projections; an MoE layer keeps its pre-MLP norm apart."""
    config = AutoConfig.from_pretrained(tiny["deepseek_r1"])
    model = build_gpt_model(config)
    local = [k for k in model.state_dict() if not k.endswith("_extra_state")]
    te = to_te_names(local, config)
    layer0, layer1 = "decoder.layers.0.", "decoder.layers.1."  # dense first layer, then MoE
    assert te[layer0 + "self_attention.q_layernorm.weight"] == layer0 + "self_attention.linear_q_up_proj.layer_norm_weight"
    assert te[layer0 + "self_attention.kv_layernorm.weight"] == layer0 + "self_attention.linear_kv_up_proj.layer_norm_weight"
    assert te[layer0 + "input_layernorm.weight"] == layer0 + "input_layernorm.weight"
    assert te[layer0 + "pre_mlp_layernorm.weight"] == layer0 + "mlp.linear_fc1.layer_norm_weight"
    assert te[layer1 + "pre_mlp_layernorm.weight"] == layer1 + "pre_mlp_layernorm.weight"
    assert from_te_names(list(te.values()), config) == {v: k for k, v in te.items()}


def test_deepseek_prediction_layers_are_skipped_but_other_extras_are_not(megatron_tp1, tiny, tmp_path):
    """A real DeepSeek-V3 checkpoint carries its multi-token-prediction layer after the last decoder layer."""
    config = AutoConfig.from_pretrained(tiny["deepseek_r1"])
    weights = load_file(tiny["deepseek_r1"] / "model.safetensors")
    mtp = dict(weights, **{"model.layers.2.eh_proj.weight": torch.ones(64, 128)})
    save_file(mtp, tmp_path / "model.safetensors")
    model = build_gpt_model(config)
    load_hf_weights(model, config, tmp_path)
    assert torch.equal(model.decoder.layers[1].mlp.router.expert_bias,
                       weights["model.layers.1.mlp.gate.e_score_correction_bias"])
    config.num_nextn_predict_layers = 0
    with pytest.raises(CheckpointMismatchError, match=r"no place for: \['model\.layers\.2\.eh_proj\.weight'\]"):
        load_hf_weights(model, config, tmp_path)


def test_bf16_checkpoint_round_trips_exactly_and_upcasts_into_fp32(megatron_tp1, tiny, tmp_path):
    """Rows are read straight into parameters of the file's dtype, and converted when the model's differs."""
    from transformers import AutoModelForCausalLM

    from twinkle_core.convert import export_hf_weights

    source = tmp_path / "bf16"
    AutoModelForCausalLM.from_pretrained(tiny["qwen2_5"], dtype=torch.bfloat16).save_pretrained(source)
    config = AutoConfig.from_pretrained(source)
    original = load_file(source / "model.safetensors")
    model = build_gpt_model(config, dtype=torch.bfloat16)
    load_hf_weights(model, config, source)
    export_hf_weights(model, config, tmp_path / "back")
    exported = load_file(tmp_path / "back" / "model.safetensors")
    assert all(exported[n].dtype == torch.bfloat16 and torch.equal(exported[n], t) for n, t in original.items())
    wide = build_gpt_model(config, dtype=torch.float32)
    load_hf_weights(wide, config, source)
    export_hf_weights(wide, config, tmp_path / "wide")
    upcast = load_file(tmp_path / "wide" / "model.safetensors")
    assert all(torch.equal(upcast[n], t.float()) for n, t in original.items())
