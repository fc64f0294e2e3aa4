"""Hugging Face config → megatron-core `TransformerConfig` + layer spec → `GPTModel` (one rank's part).

One table (`ARCHITECTURES`) says, per Hugging Face `model_type`, what megatron-core needs beyond the
shapes every decoder shares: q/k/v biases, q/k norms, multi-latent attention, mixture-of-experts. The
shapes come from the HF config. The model is built with megatron's *local* spec (plain torch layers; for MLA with
`MLACoreAttention`, as megatron's local core attention cannot take MLA's head widths), which runs on CPU
in the CPU device mode and on GPU; weights are left uninitialized by default because they are
loaded from a checkpoint (the bridge, or a dist checkpoint) right after. With `transformer_impl=
"transformer_engine"` (CUDA only; twinkle_core.megatron.engine) it is built with Transformer Engine's spec
instead: fused norm + linear layers, TE's attention (context parallelism, packed `thd` rows) and fp8.

Rotary embeddings: megatron computes the plain RoPE frequencies itself; for the scaled variants HF uses
(llama3, linear, dynamic NTK at lengths below its threshold) the builder installs the inverse frequencies
HF computes, so both models rotate by the same angles. Variants that also rescale attention (YaRN outside
MLA, longrope) are refused with the reason.

Issue 6 (training on megatron-core) builds its models through `build_gpt_model` too.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from twinkle_core.errors import UserError
from twinkle_core.megatron.parallel_state import MegatronParallel

VOCAB_DIVISIBLE_BY = 128  # megatron's default --make-vocab-size-divisible-by, times tp


class UnsupportedArchitectureError(UserError):
    """A Hugging Face architecture (or a setting of one) megatron-core's GPTModel cannot express."""


@dataclass(frozen=True)
class Architecture:
    """What a Hugging Face model_type needs from megatron-core beyond the shared decoder shapes."""

    model_type: str
    qkv_bias: bool | str = False  # True, False, or the HF config attribute that says
    qk_layernorm: bool = False  # Qwen3-style RMSNorm on each q and k head
    mla: bool = False  # DeepSeek multi-latent attention
    # None: dense. "deepseek": sigmoid router with a balance bias, group-limited top-k, shared experts.
    # "qwen": softmax top-k router (Qwen2-MoE adds a sigmoid-gated shared expert).
    moe: str | None = None


ARCHITECTURES: dict[str, Architecture] = {a.model_type: a for a in (
    Architecture("llama", qkv_bias="attention_bias"),
    Architecture("mistral"),
    Architecture("qwen2", qkv_bias=True),
    Architecture("qwen3", qk_layernorm=True),
    Architecture("qwen2_moe", qkv_bias=True, moe="qwen"),
    Architecture("qwen3_moe", qk_layernorm=True, moe="qwen"),
    Architecture("deepseek_v3", mla=True, moe="deepseek"),
)}

# Config keys any Llama-style decoder may carry: the shapes the table maps, and settings that change nothing
# the bridge computes (ids, dropout, caching, initialisation). A model_type outside ARCHITECTURES converts
# when every other key it sets is unset, false or zero; the first that is not is named in the refusal.
_LLAMA_KEYS = frozenset("""
    vocab_size hidden_size intermediate_size num_hidden_layers num_attention_heads num_key_value_heads head_dim
    hidden_act max_position_embeddings rms_norm_eps tie_word_embeddings rope_theta rope_scaling rope_parameters
    attention_bias attention_dropout mlp_bias initializer_range use_cache pretraining_tp pad_token_id
    bos_token_id eos_token_id layer_types
""".split())


def _generic_keys() -> frozenset[str]:
    from transformers import PretrainedConfig

    return frozenset(PretrainedConfig().to_dict()) | {"transformers_version", "architectures", "dtype",
                                                      "torch_dtype", "model_type", "auto_map"}


def _llama_like(hf_config) -> Architecture:
    """The table entry of a model_type the table does not list, when its config is a Llama decoder's."""
    model_type = getattr(hf_config, "model_type", None)
    values = hf_config.to_dict()
    known = _LLAMA_KEYS | _generic_keys()
    extra = {k: v for k, v in sorted(values.items()) if k not in known and v not in (None, False, 0, [], {})}
    if extra:
        (key, value), *more = extra.items()
        others = f" (nor do {[k for k, _ in more[:5]]})" if more else ""
        raise UnsupportedArchitectureError(
            f"model_type={model_type!r} is not in the bridge's table ({', '.join(sorted(ARCHITECTURES))}) and its "
            f"config key {key}={value!r} has no place in a Llama-style megatron-core GPTModel{others}; train it "
            "with backend='transformers'.")
    kinds = set(values.get("layer_types") or ["full_attention"])
    if kinds != {"full_attention"}:
        raise UnsupportedArchitectureError(f"model_type={model_type!r}: config key layer_types={sorted(kinds)} "
                                           "(megatron's GPTModel here has full attention in every layer).")
    return Architecture(model_type, qkv_bias="attention_bias")


def architecture_for(hf_config) -> Architecture:
    """The table entry of a Hugging Face config; a model_type the table lacks is checked to be Llama-like."""
    model_type = getattr(hf_config, "model_type", None)
    return ARCHITECTURES.get(model_type) or _llama_like(hf_config)


def padded_vocab_size(vocab_size: int, tp: int, divisible_by: int = VOCAB_DIVISIBLE_BY) -> int:
    """The vocabulary megatron holds: padded so each tp rank gets an equal, aligned slice."""
    multiple = divisible_by * tp
    return int(math.ceil(vocab_size / multiple) * multiple)


def head_dim(hf_config) -> int:
    return getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads


def _rope_parameters(hf_config) -> dict:
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    params.setdefault("rope_type", "default")
    params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    return params


def _check_dense(hf_config, arch: Architecture) -> None:
    problems = []
    if getattr(hf_config, "hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={hf_config.hidden_act!r} (megatron's gated MLP here uses silu)")
    if getattr(hf_config, "mlp_bias", False):
        problems.append("mlp_bias=True (MLP biases are not mapped)")
    if arch.qkv_bias == "attention_bias" and getattr(hf_config, "attention_bias", False):
        # Llama's attention_bias also puts a bias on o_proj, which megatron only has with every linear biased.
        problems.append("attention_bias=True on a Llama-type model (o_proj bias is not mapped)")
    if arch.moe == "deepseek" and getattr(hf_config, "scoring_func", "sigmoid") != "sigmoid":
        problems.append(f"scoring_func={hf_config.scoring_func!r} (the mapping covers DeepSeek-V3's sigmoid router)")
    if arch.moe == "deepseek" and not getattr(hf_config, "norm_topk_prob", True):
        problems.append("norm_topk_prob=False (megatron's sigmoid router always normalizes its top-k weights)")
    if arch.mla and not getattr(hf_config, "rope_interleave", True):
        problems.append("rope_interleave=False (megatron's MLA always de-interleaves the rotary dimensions)")
    if problems:
        raise UnsupportedArchitectureError(f"{hf_config.model_type}: " + "; ".join(problems) + ".")


def _mla_settings(hf_config) -> dict:
    """DeepSeek multi-latent attention: low-rank q and kv, a decoupled rotary part, YaRN rope."""
    rope = _rope_parameters(hf_config)
    yarn = rope["rope_type"] == "yarn"
    if rope["rope_type"] not in ("yarn", "default"):
        raise UnsupportedArchitectureError(f"{hf_config.model_type}: rope_type={rope['rope_type']!r} with "
                                           "multi-latent attention; megatron's MLA has default and yarn.")
    return dict(
        multi_latent_attention=True, q_lora_rank=hf_config.q_lora_rank, kv_lora_rank=hf_config.kv_lora_rank,
        qk_head_dim=hf_config.qk_nope_head_dim, qk_pos_emb_head_dim=hf_config.qk_rope_head_dim,
        v_head_dim=hf_config.v_head_dim, rope_type="yarn" if yarn else "rope", rotary_base=rope["rope_theta"],
        rotary_scaling_factor=rope.get("factor", 1.0),
        original_max_position_embeddings=rope.get("original_max_position_embeddings", 4096),
        beta_fast=rope.get("beta_fast", 32.0), beta_slow=rope.get("beta_slow", 1.0),
        mscale=rope.get("mscale", 1.0), mscale_all_dim=rope.get("mscale_all_dim", 0.0) or 0.0,
    )


def _moe_settings(hf_config, arch: Architecture) -> dict:
    return _deepseek_moe_settings(hf_config) if arch.moe == "deepseek" else _qwen_moe_settings(hf_config)


def _qwen_moe_layers(hf_config) -> list[int]:
    """Qwen2/Qwen3-MoE: layer i is sparse unless listed in mlp_only_layers, every decoder_sparse_step-th."""
    step = getattr(hf_config, "decoder_sparse_step", 1) or 1
    dense = set(getattr(hf_config, "mlp_only_layers", []) or [])
    return [int(i not in dense and (i + 1) % step == 0) for i in range(hf_config.num_hidden_layers)]


def _qwen_moe_settings(hf_config) -> dict:
    """Qwen2/Qwen3-MoE routing: softmax over the experts, top-k, renormalised when norm_topk_prob.

    softmax → top-k → renormalise equals top-k on the logits → softmax (megatron's default order); without
    renormalisation the top-k weights are the full softmax's (megatron's pre-softmax order).
    """
    shared = getattr(hf_config, "shared_expert_intermediate_size", None)
    return dict(
        num_moe_experts=hf_config.num_experts, moe_router_topk=hf_config.num_experts_per_tok,
        moe_ffn_hidden_size=hf_config.moe_intermediate_size, moe_layer_freq=moe_layer_pattern(hf_config),
        moe_router_score_function="softmax", moe_router_pre_softmax=not getattr(hf_config, "norm_topk_prob", False),
        moe_shared_expert_intermediate_size=shared or None, moe_shared_expert_gate=bool(shared),
        moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0, moe_token_dispatcher_type="alltoall",
        moe_grouped_gemm=False, moe_router_dtype="fp32",
    )


def moe_layer_pattern(hf_config) -> list[int]:
    """1 for each decoder layer with routed experts, 0 for a dense one."""
    moe = architecture_for(hf_config).moe
    if moe == "qwen":
        return _qwen_moe_layers(hf_config)
    dense_first = getattr(hf_config, "first_k_dense_replace", 0) if moe else hf_config.num_hidden_layers
    return [0] * dense_first + [1] * (hf_config.num_hidden_layers - dense_first)


def num_routed_experts(hf_config) -> int | None:
    """The routed experts of a mixture-of-experts config the bridge maps (None: dense)."""
    moe = architecture_for(hf_config).moe
    return {"deepseek": getattr(hf_config, "n_routed_experts", None),
            "qwen": getattr(hf_config, "num_experts", None)}.get(moe)


def _deepseek_moe_settings(hf_config) -> dict:
    """DeepSeek-V3 routing: sigmoid scores plus a balance bias, group-limited top-k, scaled, shared experts."""
    return dict(
        num_moe_experts=hf_config.n_routed_experts, moe_router_topk=hf_config.num_experts_per_tok,
        moe_ffn_hidden_size=hf_config.moe_intermediate_size,
        moe_shared_expert_intermediate_size=(hf_config.n_shared_experts * hf_config.moe_intermediate_size
                                             if hf_config.n_shared_experts else None),
        moe_layer_freq=moe_layer_pattern(hf_config), moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_topk_scaling_factor=hf_config.routed_scaling_factor,
        moe_router_num_groups=hf_config.n_group, moe_router_group_topk=hf_config.topk_group,
        # Converting and checking needs no balancing loss; training (issue 6) sets its own.
        moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0, moe_token_dispatcher_type="alltoall",
        moe_grouped_gemm=False, moe_router_dtype="fp32",
    )


def check_layout(hf_config, layout: MegatronParallel) -> None:
    """Refuse a layout megatron cannot split this model into, naming the option and what would work."""
    problems = []
    groups = hf_config.num_key_value_heads
    if groups % layout.tp:
        divisors = [n for n in range(1, groups + 1) if groups % n == 0]
        problems.append(f"tp={layout.tp} does not divide the {groups} key/value heads (megatron splits whole "
                        f"query groups); use tp in {divisors}")
    experts = num_routed_experts(hf_config)
    if layout.ep > 1 and not experts:
        problems.append(f"ep={layout.ep} needs a mixture-of-experts model and this one has no experts; use ep=1")
    elif experts and experts % layout.ep:
        problems.append(f"ep={layout.ep} does not divide the {experts} routed experts; use an ep that does")
    problems += _expert_tensor_parallel_problems(hf_config, layout, experts)
    stages = layout.pp * (layout.vpp or 1)
    if hf_config.num_hidden_layers % stages:
        problems.append(f"pp={layout.pp}" + (f" x vpp={layout.vpp}" if layout.vpp else "") + f" does not divide "
                        f"the {hf_config.num_hidden_layers} layers; use stages that do")
    if problems:
        raise UnsupportedArchitectureError(f"{hf_config.model_type}: " + "; ".join(problems) + ".")


def _expert_tensor_parallel_problems(hf_config, layout: MegatronParallel, experts: int | None) -> list[str]:
    if layout.etp is None:
        return []
    if not experts:
        return [f"etp={layout.etp} splits routed experts and this model has none; leave etp empty"]
    ffn = hf_config.moe_intermediate_size
    if ffn % layout.etp:  # each etp rank holds whole rows of every expert's gate/up and columns of its down
        return [f"etp={layout.etp} does not divide the experts' ffn size {ffn} (moe_intermediate_size); use an "
                f"etp that does (etp=1 keeps every expert whole)"]
    return []


def check_architecture(hf_config) -> Architecture:
    """Everything about the config megatron-core cannot express, raised before anything is built."""
    arch = architecture_for(hf_config)
    _check_dense(hf_config, arch)
    if arch.mla:
        _mla_settings(hf_config)
    else:
        _hf_inverse_frequencies(hf_config)
    return arch


def transformer_config_from_hf(hf_config, layout: MegatronParallel = MegatronParallel(),
                               dtype: torch.dtype = torch.float32, init_weights: bool = False,
                               transformer_impl: str = "local", fp8: dict | None = None):
    """The megatron `TransformerConfig` that computes what the HF model computes, split as `layout` says.

    `transformer_impl`: "local" or "transformer_engine" (twinkle_core.megatron.engine); `fp8`: TE's fp8
    fields (`engine.fp8_settings`), None for none.
    """
    from megatron.core.transformer import MLATransformerConfig, TransformerConfig

    te = transformer_impl == "transformer_engine"
    if (fp8 or layout.cp > 1) and not te:
        raise ValueError("fp8 and context parallelism compute in Transformer Engine's layers; build with "
                         "transformer_impl='transformer_engine'.")
    arch = architecture_for(hf_config)
    _check_dense(hf_config, arch)
    check_layout(hf_config, layout)
    qkv_bias = getattr(hf_config, arch.qkv_bias, False) if isinstance(arch.qkv_bias, str) else arch.qkv_bias
    extra = {**(_mla_settings(hf_config) if arch.mla else {}), **(_moe_settings(hf_config, arch) if arch.moe else {})}
    config_class = MLATransformerConfig if arch.mla else TransformerConfig
    return config_class(
        num_layers=hf_config.num_hidden_layers, hidden_size=hf_config.hidden_size,
        num_attention_heads=hf_config.num_attention_heads, num_query_groups=hf_config.num_key_value_heads,
        kv_channels=head_dim(hf_config), ffn_hidden_size=hf_config.intermediate_size,
        normalization="RMSNorm", layernorm_epsilon=hf_config.rms_norm_eps, gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, add_qkv_bias=bool(qkv_bias),
        # MLA's q/kv latent norms are its "qk layernorm" in megatron's spec.
        qk_layernorm=arch.qk_layernorm or arch.mla, hidden_dropout=0.0, attention_dropout=0.0,
        # The fused kernels are CUDA (or Apex/TE) code; the plain ones compute the same. Under TE its fused
        # RoPE kernel runs (also for packed `thd` rows); weight-gradient fusion would need Apex for the output layer.
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        apply_rope_fusion=te, gradient_accumulation_fusion=False, persist_layer_norm=False,
        transformer_impl=transformer_impl, context_parallel_size=layout.cp, **(fp8 or {}),
        params_dtype=dtype, pipeline_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
        tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp,
        expert_model_parallel_size=layout.ep, expert_tensor_parallel_size=layout.expert_tp,
        sequence_parallel=layout.sequence_parallel,
        # TE's layers are built straight on the GPU; the local spec on the CPU (the CPU device mode needs it)
        use_cpu_initialization=not te, perform_initialization=init_weights,
        **extra,
    )


def _hf_inverse_frequencies(hf_config) -> tuple[torch.Tensor | None, float]:
    """HF's inverse RoPE frequencies where they differ from plain RoPE (None: megatron's own are HF's), and
    the factor HF scales cos and sin by (YaRN's attention factor; 1 otherwise)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope_type = _rope_parameters(hf_config)["rope_type"]
    if rope_type == "default":
        return None, 1.0
    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise UnsupportedArchitectureError(f"rope_type={rope_type!r} is not known to transformers.")
    inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, None)
    if attention_scaling != 1.0 and rope_type != "yarn":
        raise UnsupportedArchitectureError(
            f"rope_type={rope_type!r} rescales attention by {attention_scaling}, which megatron's GPTModel "
            f"RoPE does not; supported: default, llama3, linear, dynamic, yarn.")
    return inv_freq.float(), float(attention_scaling)


def _scale_rotary_like_hf(config, hf_config, attention_scaling: float) -> None:
    """YaRN outside MLA: megatron's attention multiplies cos and sin by the concentration factor its config's
    yarn_* attributes give; set them so that factor is HF's attention factor, or refuse."""
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
        _yarn_get_concentration_factor_from_config)

    rope = _rope_parameters(hf_config)
    config.yarn_rotary_scaling_factor = rope.get("factor", 1.0)
    config.yarn_mscale, config.yarn_mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
    theirs = _yarn_get_concentration_factor_from_config(config)
    if abs(theirs - attention_scaling) > 1e-12:
        raise UnsupportedArchitectureError(
            f"rope_parameters attention_factor: HF scales cos/sin by {attention_scaling}, megatron's YaRN factor "
            f"from factor/mscale/mscale_all_dim is {theirs}.")


def build_gpt_chunks(hf_config, layout: MegatronParallel = MegatronParallel(), dtype: torch.dtype = torch.float32,
                     init_weights: bool = False, transformer_impl: str = "local", fp8: dict | None = None) -> list:
    """This rank's model chunks: one GPTModel, or with virtual pipeline stages one per stage (same config)."""
    config = transformer_config_from_hf(hf_config, layout, dtype, init_weights, transformer_impl, fp8)
    return [build_gpt_model(hf_config, layout, dtype, init_weights, vp_stage=stage, config=config)
            for stage in (range(layout.vpp) if layout.vpp else [None])]


def build_gpt_model(hf_config, layout: MegatronParallel = MegatronParallel(), dtype: torch.dtype = torch.float32,
                    init_weights: bool = False, vp_stage: int | None = None, config=None):
    """This rank's part of the megatron `GPTModel` for `hf_config` (megatron's groups must be initialized);
    with virtual pipeline stages, the chunk of stage `vp_stage` (see build_gpt_chunks). The layer spec
    follows `config.transformer_impl`: megatron's local spec, or Transformer Engine's (whose fused norm +
    linear layers the bridge names with `convert.from_te_names`)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    from twinkle_core.megatron.mla_core_attention import MLACoreAttention
    from twinkle_core.megatron.mla_tensor_parallel import sum_rotary_key_gradients
    from twinkle_core.megatron.output_grad import keep_output_grad_contiguous
    from twinkle_core.megatron.sequence_parallel_norm import use_sequence_parallel_norms

    config = config or transformer_config_from_hf(hf_config, layout, dtype, init_weights)
    rope = _rope_parameters(hf_config)
    te = config.transformer_impl == "transformer_engine"
    # The block spec gives each layer its own spec: dense or MoE as moe_layer_freq says.
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=te, normalization="RMSNorm",
                                      vp_stage=vp_stage)
    if layout.sequence_parallel and not te:  # TE's norms support sequence parallelism themselves
        # MLA's latent norms included: megatron scatters the latents along the sequence before them.
        use_sequence_parallel_norms(spec)
    if config.multi_latent_attention and not te:  # TE's attention takes MLA's head widths
        for layer_spec in spec.layer_specs:
            attention = layer_spec.submodules.self_attention.submodules
            attention.core_attention = MLACoreAttention
    model = GPTModel(
        config=config, transformer_layer_spec=spec,
        vocab_size=padded_vocab_size(hf_config.vocab_size, layout.tp),
        max_sequence_length=hf_config.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage),
        post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage),
        vp_stage=vp_stage,
        share_embeddings_and_output_weights=bool(getattr(hf_config, "tie_word_embeddings", False)),
        position_embedding_type="rope", rotary_base=rope["rope_theta"],
        rotary_percent=rope.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", 1.0)),
    )
    keep_output_grad_contiguous(model)  # else a frozen output weight is copied once per position in backward
    if config.multi_latent_attention:
        # qk_layernorm only told the spec to build MLA's latent norms. Left on, megatron's finalize_model_grads
        # sums every `q_layernorm` gradient over tp (right for per-head q norms), but MLA's latent is whole on
        # every rank, so its gradient would count tp times (under sequence parallelism the norm's tag sums it).
        config.qk_layernorm = False
        sum_rotary_key_gradients(model)  # megatron loses part of the shared rotary key's gradient under tp
    if not init_weights:
        _mark_tensor_parallel_weights(model)
    if layout.expert_tp != layout.tp:
        _reduce_experts_over_expert_data_parallel(model)
    if not config.multi_latent_attention:
        inv_freq, attention_scaling = _hf_inverse_frequencies(hf_config)
        if inv_freq is not None:
            model.rotary_pos_emb.inv_freq = inv_freq
        if attention_scaling != 1.0:
            _scale_rotary_like_hf(config, hf_config, attention_scaling)
    return model


def _mark_tensor_parallel_weights(model) -> None:
    """Tag split weights as megatron's initialisers would have (they are skipped without initialisation).

    Megatron's grad norm counts a weight on every tp rank only when it is tagged as split; untagged it
    counts tp rank 0's shard alone, and clipping would use too small a norm.
    """
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    for module in model.modules():
        dim = {ColumnParallelLinear: 0, VocabParallelEmbedding: 0, RowParallelLinear: 1}.get(type(module))
        if dim is None and getattr(module, "parallel_mode", None) in ("column", "row"):  # TE's linears
            dim = 0 if module.parallel_mode == "column" else 1
        weight = getattr(module, "weight", None)
        if dim is not None and isinstance(weight, torch.nn.Parameter) and not hasattr(weight, "tensor_model_parallel"):
            set_tensor_model_parallel_attributes(weight, is_parallel=True, dim=dim, stride=1)


def _reduce_experts_over_expert_data_parallel(model) -> None:
    """Tag the routed experts' weights as megatron's expert-parallel ones (`allreduce=False`).

    megatron-core 0.16 tags them only when ep > 1. Untagged, its DDP and optimizer reduce their gradients
    over the dense data-parallel group, which holds the ranks of the experts' own data-parallel group only
    while etp == tp; with etp != tp (measured, ep=1) they would add up different shards of one expert
    (tp=1, etp=2) or leave the copies of a whole expert unsynchronised (tp=2, etp=1).
    """
    from megatron.core.transformer.moe.moe_layer import MoELayer

    for module in model.modules():
        if isinstance(module, MoELayer):
            for param in module.experts.parameters():
                param.allreduce = False
