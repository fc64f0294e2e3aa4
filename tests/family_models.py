"""Tiny random checkpoints of every supported model family, written as a real download would be.

Each family's config is its real config shape shrunk (2 layers, or 3 where the family mixes layer kinds;
hidden 64; a few heads with the family's GQA ratio; 4 experts, top-2, where it is MoE), with the real
rope type, embedding tying, special tokens, BOS convention and generation_config stop tokens. No chat
template is written unless one is given: the family registry supplies those.

    path = save_tiny_family_model("qwen3_5", tmp_path / "q35", variant="moe")
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import save_file
from tokenizers import processors
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig, PreTrainedModel

from tiny_models import make_tiny_tokenizer

HIDDEN = 64
SEED = 0

FAMILY_VARIANTS: dict[str, list[str]] = {
    "qwen3_5": ["dense", "moe"],
    "qwen3": ["dense", "moe"],
    "qwen2_5": ["dense"],
    "llama3": ["dense"],
    "mistral": ["dense"],
    "yi": ["dense"],
    "glm4": ["dense"],
    "deepseek_r1": ["moe"],
    "deepseek_v4": ["moe"],
    "internlm2_5": ["dense"],
}


@dataclass(frozen=True)
class Tokens:
    """A family's special tokens as its tokenizer_config / generation_config name them."""

    special: tuple[str, ...]
    eos: str
    bos: str | None
    pad: str | None
    stop: tuple[str, ...]  # generation_config.eos_token_id, in the real checkpoint's order
    add_bos: bool = False  # the tokenizer itself prepends BOS (encode(..., add_special_tokens=True))
    config_bos: str | None = None  # config.json bos_token_id where the tokenizer has no BOS token
    config_eos_lists_stops: bool = False  # config.json eos_token_id is the whole stop list, not the eos token


_CHATML = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
_QWEN = _CHATML + ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>",
                   "</tool_call>", "<tool_response>", "</tool_response>")
_DEEPSEEK = ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<think>", "</think>",
             "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
             "<｜tool▁sep｜>", "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>",
             "<｜tool▁output▁end｜>")
_DS_BOS, _DS_EOS = _DEEPSEEK[0], _DEEPSEEK[1]

TOKENS: dict[str, Tokens] = {
    # Qwen instruct checkpoints: no BOS in the tokenizer, <|im_end|> ends a turn, <|endoftext|> pads.
    "qwen3_5": Tokens(_QWEN + ("<think>", "</think>"), "<|im_end|>", None, "<|endoftext|>",
                      ("<|im_end|>", "<|endoftext|>"), config_bos="<|endoftext|>"),
    "qwen3": Tokens(_QWEN + ("<think>", "</think>"), "<|im_end|>", None, "<|endoftext|>",
                    ("<|im_end|>", "<|endoftext|>"), config_bos="<|endoftext|>"),
    "qwen2_5": Tokens(_QWEN, "<|im_end|>", None, "<|endoftext|>", ("<|im_end|>", "<|endoftext|>"),
                      config_bos="<|endoftext|>"),
    # Llama 3.1/3.3 instruct: BOS prepended by the tokenizer, no pad token, three stop tokens.
    "llama3": Tokens(("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                      "<|eot_id|>", "<|eom_id|>", "<|python_tag|>", "<|finetune_right_pad_id|>"),
                     "<|eot_id|>", "<|begin_of_text|>", None, ("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"),
                     add_bos=True, config_eos_lists_stops=True),
    # Mistral-7B-Instruct-v0.3 (v3 tokenizer with tool tokens).
    "mistral": Tokens(("<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]",
                       "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]"),
                      "</s>", "<s>", None, ("</s>",), add_bos=True),
    # Yi-1.5 chat: ChatML turns, <|startoftext|> BOS not added by the tokenizer, <unk> pads.
    "yi": Tokens(("<unk>", "<|startoftext|>") + _CHATML + ("<|im_sep|>",), "<|im_end|>", "<|startoftext|>",
                 "<unk>", ("<|im_end|>", "<|endoftext|>")),
    # GLM-4-9B-0414: [gMASK]<sop> open every prompt (written by the template), three stop tokens.
    "glm4": Tokens(("<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>", "<|system|>", "<|user|>",
                    "<|assistant|>", "<|observation|>", "<|begin_of_image|>", "<|end_of_image|>"),
                   "<|endoftext|>", None, "<|endoftext|>", ("<|endoftext|>", "<|user|>", "<|observation|>"),
                   config_eos_lists_stops=True),
    "deepseek_r1": Tokens(_DEEPSEEK, _DS_EOS, _DS_BOS, _DS_EOS, (_DS_EOS,), add_bos=True),
    # V4 writes tool calls in DSML (<｜DSML｜function_calls>...), like V3.2.
    "deepseek_v4": Tokens(_DEEPSEEK + ("｜DSML｜",), _DS_EOS, _DS_BOS, _DS_EOS, (_DS_EOS,), add_bos=True),
    "internlm2_5": Tokens(("<unk>", "<s>", "</s>") + _CHATML + ("<|action_start|>", "<|action_end|>",
                                                               "<|interpreter|>", "<|plugin|>"),
                          "</s>", "<s>", "</s>", ("</s>", "<|im_end|>"), add_bos=True),
}


def family_tokenizer(family: str, chat_template: str | None = None):
    """A tiny byte-level BPE tokenizer carrying the family's special tokens and BOS/EOS/pad convention."""
    spec = TOKENS[_check_family(family)]
    tokenizer = make_tiny_tokenizer(
        extra_special_tokens=spec.special, chat_template=chat_template,
        bos_token=spec.bos or spec.eos, eos_token=spec.eos, pad_token=spec.pad or spec.eos,
    )
    tokenizer.bos_token = spec.bos
    tokenizer.pad_token = spec.pad
    if spec.add_bos:
        bos_id = tokenizer.convert_tokens_to_ids(spec.bos)
        tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{spec.bos} $A", pair=f"{spec.bos} $A {spec.bos} $B", special_tokens=[(spec.bos, bos_id)],
        )
    return tokenizer


# ----- configs: each the real checkpoint's shape, shrunk ------------------------------------------------
def _ids(tokenizer) -> Callable[[str | None], int | None]:
    return lambda token: None if token is None else tokenizer.convert_tokens_to_ids(token)


def _common(family: str, tokenizer) -> dict:
    spec, tid = TOKENS[family], _ids(tokenizer)
    eos = [tid(t) for t in spec.stop] if spec.config_eos_lists_stops else tid(spec.eos)
    return dict(vocab_size=len(tokenizer), bos_token_id=tid(spec.bos or spec.config_bos), eos_token_id=eos,
                pad_token_id=tid(spec.pad), hidden_size=HIDDEN, num_hidden_layers=2)


def _qwen3_5_text(common: dict, moe: bool) -> dict:
    # Qwen3.5: gated-delta-net linear attention, then a gated full-attention layer (every 4th in the real
    # checkpoint), partial interleaved M-RoPE over a quarter of each head.
    text = dict(common, model_type="qwen3_5_moe_text" if moe else "qwen3_5_text",
                layer_types=["linear_attention", "full_attention"], num_attention_heads=4, num_key_value_heads=2,
                head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                linear_value_head_dim=16, linear_conv_kernel_dim=4, max_position_embeddings=262144,
                rms_norm_eps=1e-6, tie_word_embeddings=not moe,
                rope_parameters={"rope_type": "default", "rope_theta": 10_000_000, "partial_rotary_factor": 0.25,
                                 "mrope_section": [2, 1, 1], "mrope_interleaved": True})
    if moe:  # Qwen3.5-35B-A3B-like: routed experts + one gated shared expert in every layer
        text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                    shared_expert_intermediate_size=32, router_aux_loss_coef=0.001)
    else:
        text.update(intermediate_size=128)
    return text


def _qwen3_5(family: str, variant: str, tokenizer) -> PreTrainedModel:
    """The real top-level `qwen3_5`/`qwen3_5_moe` checkpoint: a VLM with a (tiny) vision tower.

    AutoModelForCausalLM loads it as the text-only ForCausalLM, dropping `model.visual.*`.
    """
    from transformers import Qwen3_5ForConditionalGeneration, Qwen3_5MoeForConditionalGeneration

    moe = variant == "moe"
    text = _qwen3_5_text(_common(family, tokenizer), moe)
    tid = _ids(tokenizer)
    config = AutoConfig.for_model(
        "qwen3_5_moe" if moe else "qwen3_5", text_config=text, tie_word_embeddings=text["tie_word_embeddings"],
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=HIDDEN,
                           num_position_embeddings=64, patch_size=16, spatial_merge_size=2, temporal_patch_size=2),
        image_token_id=tid("<|image_pad|>"), video_token_id=tid("<|video_pad|>"),
        vision_start_token_id=tid("<|vision_start|>"), vision_end_token_id=tid("<|vision_end|>"),
    )
    cls = Qwen3_5MoeForConditionalGeneration if moe else Qwen3_5ForConditionalGeneration
    return cls(config)


def _text_config(family: str, variant: str, tokenizer):
    common = _common(family, tokenizer)
    if family == "qwen2_5":  # Qwen2.5-7B-Instruct: qkv bias (always on in qwen2), GQA 7:1, untied
        return AutoConfig.for_model("qwen2", **common, intermediate_size=128, num_attention_heads=4,
                                    num_key_value_heads=2, rope_theta=1_000_000.0, max_position_embeddings=32768,
                                    rms_norm_eps=1e-6, use_sliding_window=False, sliding_window=131072,
                                    max_window_layers=28, tie_word_embeddings=False)
    if family == "qwen3" and variant == "dense":  # Qwen3-8B: RMSNorm per q/k head, GQA 4:1, head_dim 128 ≠ 4096/32
        return AutoConfig.for_model("qwen3", **common, intermediate_size=128, num_attention_heads=4,
                                    num_key_value_heads=1, head_dim=32, max_position_embeddings=40960,
                                    rms_norm_eps=1e-6, tie_word_embeddings=False, use_sliding_window=False,
                                    rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0})
    if family == "qwen3":  # Qwen3-30B-A3B: every layer MoE, softmax top-k renormalised, no shared expert
        return AutoConfig.for_model("qwen3_moe", **common, intermediate_size=128, moe_intermediate_size=32,
                                    num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
                                    mlp_only_layers=[], router_aux_loss_coef=0.001, num_attention_heads=4,
                                    num_key_value_heads=1, head_dim=32, max_position_embeddings=40960,
                                    rms_norm_eps=1e-6, tie_word_embeddings=False, use_sliding_window=False,
                                    rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0})
    if family == "llama3":  # Llama-3.1-8B-Instruct: llama3 rope scaling, GQA 4:1, untied
        return AutoConfig.for_model("llama", **common, intermediate_size=224, num_attention_heads=4,
                                    num_key_value_heads=1, max_position_embeddings=131072, rms_norm_eps=1e-5,
                                    tie_word_embeddings=False,
                                    rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                                     "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                     "original_max_position_embeddings": 8192})
    if family == "mistral":  # Mistral-7B-Instruct-v0.3: no sliding window, rope_theta 1e6, GQA 4:1
        return AutoConfig.for_model("mistral", **common, intermediate_size=224, num_attention_heads=4,
                                    num_key_value_heads=1, head_dim=16, sliding_window=None,
                                    max_position_embeddings=32768, rms_norm_eps=1e-5, tie_word_embeddings=False,
                                    rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0})
    if family == "yi":  # Yi-1.5-9B-Chat: llama architecture, rope_theta 5e6, GQA 8:1, untied
        return AutoConfig.for_model("llama", **common, intermediate_size=176, num_attention_heads=8,
                                    num_key_value_heads=1, max_position_embeddings=4096, rms_norm_eps=1e-6,
                                    tie_word_embeddings=False,
                                    rope_parameters={"rope_type": "default", "rope_theta": 5_000_000.0})
    if family == "glm4":  # GLM-4-9B-0414: qkv bias, half-rotary rope, sandwich norms, GQA 16:1
        return AutoConfig.for_model("glm4", **common, intermediate_size=208, num_attention_heads=4,
                                    num_key_value_heads=1, head_dim=16, attention_bias=True,
                                    max_position_embeddings=32768, rms_norm_eps=1e-5, tie_word_embeddings=False,
                                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                     "partial_rotary_factor": 0.5})
    if family == "deepseek_r1":
        # DeepSeek-R1 (V3 architecture): MLA, first layer dense then MoE with grouped sigmoid routing,
        # a bias for balance (noaux_tc), one shared expert, YaRN rope.
        return AutoConfig.for_model(
            "deepseek_v3", **common, intermediate_size=128, moe_intermediate_size=32, first_k_dense_replace=1,
            n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
            routed_scaling_factor=2.5, norm_topk_prob=True, scoring_func="sigmoid", topk_method="noaux_tc",
            num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
            qk_rope_head_dim=8, v_head_dim=16, max_position_embeddings=163840, rms_norm_eps=1e-6,
            num_nextn_predict_layers=1, tie_word_embeddings=False,
            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                             "original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0,
                             "mscale": 1.0, "mscale_all_dim": 1.0},
        )
    if family == "deepseek_v4":
        # DeepSeek-V4-Flash: single-KV-head attention with a low-rank query, sliding window + compressed
        # sparse attention (lightning indexer), grouped low-rank output, hyper-connections, a hash-routed
        # MoE layer then a learned-router one (sqrt-softplus scores), shared expert, YaRN on compressed keys.
        return AutoConfig.for_model(
            "deepseek_v4", **common, moe_intermediate_size=32, num_attention_heads=4, num_key_value_heads=1,
            head_dim=32, q_lora_rank=32, partial_rotary_factor=0.25, n_routed_experts=4, n_shared_experts=1,
            num_experts_per_tok=2, scoring_func="sqrtsoftplus", routed_scaling_factor=1.5,
            layer_types=["sliding_attention", "compressed_sparse_attention"], mlp_layer_types=["hash_moe", "moe"],
            compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
            hc_mult=2, sliding_window=8, o_groups=2, o_lora_rank=16, index_n_heads=2, index_head_dim=16,
            index_topk=4, max_position_embeddings=1048576, rms_norm_eps=1e-6, tie_word_embeddings=False,
            rope_parameters={"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 65536,
                             "beta_fast": 32.0, "beta_slow": 1.0},
        )
    if family == "internlm2_5":  # the Llama twin of internlm2_5-7b-chat: GQA 4:1, dynamic NTK rope
        return AutoConfig.for_model("llama", **common, intermediate_size=224, num_attention_heads=8,
                                    num_key_value_heads=2, max_position_embeddings=32768, rms_norm_eps=1e-5,
                                    tie_word_embeddings=False,
                                    rope_parameters={"rope_type": "dynamic", "rope_theta": 1_000_000.0,
                                                     "factor": 2.0})
    raise AssertionError(f"no config for family {family!r}")  # _check_family ran first


def _build(family: str, variant: str, tokenizer) -> PreTrainedModel:
    torch.manual_seed(SEED)
    if family == "qwen3_5":
        model = _qwen3_5(family, variant, tokenizer)
    else:
        model = AutoModelForCausalLM.from_config(_text_config(family, variant, tokenizer))
    if family == "deepseek_v4":
        _fill_hash_routes(model)
    spec, tid = TOKENS[family], _ids(tokenizer)
    model.generation_config = GenerationConfig(
        bos_token_id=tid(spec.bos or spec.config_bos), eos_token_id=[tid(t) for t in spec.stop],
        pad_token_id=tid(spec.pad),
    )
    return model


def _fill_hash_routes(model: PreTrainedModel) -> None:
    """Give each token k distinct experts, as a real V4 checkpoint's `tid2eid` table does (init is zeros)."""
    generator = torch.Generator().manual_seed(SEED)
    for module in model.modules():
        table = getattr(module, "tid2eid", None)
        if table is not None:
            vocab, k = table.shape
            ranks = torch.rand(vocab, module.num_experts, generator=generator).argsort(dim=-1)
            table.copy_(ranks[:, :k])


# ----- public API ------------------------------------------------------------------------------------------
def save_tiny_family_model(
    family: str, directory: str | Path, variant: str | None = None, tokenizer_chat_template: str | None = None
) -> Path:
    """Write a tiny random checkpoint of `family`/`variant` (config, safetensors, tokenizer) and return it."""
    family = _check_family(family)
    variant = _check_variant(family, variant)
    directory = Path(directory)
    tokenizer = family_tokenizer(family, tokenizer_chat_template)
    model = _build(family, variant, tokenizer)
    if family == "internlm2_5":
        _save_internlm2(model, tokenizer, directory)
    else:
        model.save_pretrained(directory)
        tokenizer.save_pretrained(directory)
    return directory


def tiny_internlm2_reference(directory: str | Path) -> Path:
    """The Llama checkpoint whose weights `save_tiny_family_model("internlm2_5", ...)` packs (same seed).

    A correct InternLM2 → Llama conversion of that checkpoint must reproduce this model's logits.
    """
    directory = Path(directory)
    tokenizer = family_tokenizer("internlm2_5")
    _build("internlm2_5", "dense", tokenizer).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


# ----- InternLM2's own checkpoint format --------------------------------------------------------------------
def pack_internlm2_wqkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """Fuse Llama q/k/v weights into InternLM2's `wqkv`: per KV group, its query heads, then its k and v head.

    InternLM2 unpacks `wqkv(x).view(b, t, num_kv_heads, groups + 2, head_dim)` as q = [..., :-2, :],
    k = [..., -2, :], v = [..., -1, :]; query head g * groups + i is group g's i-th slot.
    """
    hidden = q.shape[1]
    head_dim = k.shape[0] // num_kv_heads
    groups = q.shape[0] // k.shape[0]
    q = q.view(num_kv_heads, groups, head_dim, hidden)
    k = k.view(num_kv_heads, 1, head_dim, hidden)
    v = v.view(num_kv_heads, 1, head_dim, hidden)
    return torch.cat([q, k, v], dim=1).reshape(-1, hidden)


def _save_internlm2(model: PreTrainedModel, tokenizer, directory: Path) -> None:
    """Write `model` (a Llama) as internlm/internlm2_5-7b-chat ships: its tensor names, config and auto_map."""
    cfg = model.config
    tensors = {"model.tok_embeddings.weight": model.model.embed_tokens.weight,
               "model.norm.weight": model.model.norm.weight, "output.weight": model.lm_head.weight}
    for i, layer in enumerate(model.model.layers):
        attn, mlp, p = layer.self_attn, layer.mlp, f"model.layers.{i}."
        tensors.update({
            p + "attention.wqkv.weight": pack_internlm2_wqkv(attn.q_proj.weight, attn.k_proj.weight,
                                                             attn.v_proj.weight, cfg.num_key_value_heads),
            p + "attention.wo.weight": attn.o_proj.weight,
            p + "feed_forward.w1.weight": mlp.gate_proj.weight,
            p + "feed_forward.w3.weight": mlp.up_proj.weight,
            p + "feed_forward.w2.weight": mlp.down_proj.weight,
            p + "attention_norm.weight": layer.input_layernorm.weight,
            p + "ffn_norm.weight": layer.post_attention_layernorm.weight,
        })
    directory.mkdir(parents=True, exist_ok=True)
    save_file({k: t.detach().contiguous() for k, t in tensors.items()}, directory / "model.safetensors",
              metadata={"format": "pt"})
    config = {
        "architectures": ["InternLM2ForCausalLM"],
        "attn_implementation": "eager",
        "auto_map": {"AutoConfig": "configuration_internlm2.InternLM2Config",
                     "AutoModelForCausalLM": "modeling_internlm2.InternLM2ForCausalLM",
                     "AutoModel": "modeling_internlm2.InternLM2ForCausalLM"},
        "bias": False, "bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id, "hidden_act": "silu",
        "hidden_size": cfg.hidden_size, "initializer_range": 0.02, "intermediate_size": cfg.intermediate_size,
        "max_position_embeddings": cfg.max_position_embeddings, "model_type": "internlm2",
        "num_attention_heads": cfg.num_attention_heads, "num_hidden_layers": cfg.num_hidden_layers,
        "num_key_value_heads": cfg.num_key_value_heads, "pad_token_id": cfg.pad_token_id, "pretraining_tp": 1,
        "rms_norm_eps": cfg.rms_norm_eps, "rope_scaling": {"type": "dynamic", "factor": 2.0},
        "rope_theta": 1000000, "tie_word_embeddings": False, "torch_dtype": "float32",
        "transformers_version": "4.41.0", "use_cache": True, "vocab_size": cfg.vocab_size,
    }
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    model.generation_config.save_pretrained(directory)
    # tokenizer_config.json names InternLM2's own tokenizer classes, as the real repository's does (which ships
    # a SentencePiece tokenizer.model; this one keeps its tokenizer.json).
    tokenizer.save_pretrained(directory)
    path = directory / "tokenizer_config.json"
    settings = json.loads(path.read_text())
    settings.update(tokenizer_class="InternLM2Tokenizer", auto_map={"AutoTokenizer": [
        "tokenization_internlm2.InternLM2Tokenizer", "tokenization_internlm2_fast.InternLM2TokenizerFast"]})
    path.write_text(json.dumps(settings, indent=2) + "\n")


def _check_family(family: str) -> str:
    if family not in FAMILY_VARIANTS:
        raise ValueError(f"family={family!r} is not a known family; use one of {sorted(FAMILY_VARIANTS)}.")
    return family


def _check_variant(family: str, variant: str | None) -> str:
    variants = FAMILY_VARIANTS[family]
    if variant is None:
        return variants[0]
    if variant not in variants:
        raise ValueError(f"variant={variant!r} is not a variant of {family!r}; use one of {variants}.")
    return variant
