"""Which Hugging Face tensors make each megatron-core GPTModel parameter: one declarative table per architecture.

A `Rule` names a megatron parameter (relative to the model, or to a decoder layer), the HF tensors it is
made of (with `{i}` for the global layer index), the transform between them and how tensor parallelism
splits it. The transforms (see `transforms.py`) are few and generic:

  copy      the same tensor                       (norms; split by `tp_dim` when parallel)
  qkv       q, k, v → linear_qkv, interleaved per query group: [group's q heads, its k head, its v head]
  gate_up   gate, up → linear_fc1 = [gate; up]; a tp rank holds [its gate rows; its up rows]
  vocab     embedding / output rows, padded with zero rows to megatron's padded vocabulary

Names are those of megatron's *local* layer spec. The Transformer-Engine spec fuses some norms into the
following linear layers (`linear_qkv.layer_norm_weight`, `linear_fc1.layer_norm_weight`, and MLA's
`linear_q_up_proj` / `linear_kv_up_proj`); `to_te_names` / `from_te_names` translate, so a checkpoint keyed
the TE way maps through the same table.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from twinkle_core.megatron.model_builder import Architecture, architecture_for

COLUMN, ROW = 0, 1  # the tensor-parallel split dimension of column- and row-parallel linears


@dataclass(frozen=True)
class Rule:
    megatron: str  # name relative to the model or (layer rules) to `decoder.layers.<local>.`; `{e}`: local expert
    hf: tuple[str, ...]  # source tensor names; `{i}` is the global layer index, `{e}` the global expert index
    transform: str = "copy"  # copy | qkv | gate_up | vocab
    tp_dim: int | None = None  # None: every tp rank holds all of it
    exported: bool = True  # False: a copy of tensors another rule exports (a tied output layer)

    @property
    def is_expert(self) -> bool:
        """A routed expert's weight: split by expert-tensor parallelism, spread over expert-parallel ranks."""
        return "{e}" in self.megatron

    def hf_names(self, layer: int | None = None, expert: int | None = None) -> tuple[str, ...]:
        return tuple(name.format(i=layer, e=expert) for name in self.hf)

    def match(self, name: str) -> int | None | bool:
        """False if `name` is not this rule's; else the local expert index it names (None: not an expert)."""
        if not self.is_expert:
            return None if name == self.megatron else False
        match = re.fullmatch(re.escape(self.megatron).replace(r"\{e\}", r"(\d+)"), name)
        return int(match.group(1)) if match else False


@dataclass(frozen=True)
class MappingTable:
    """All rules of one architecture: model-level (embeddings, final norm, output) and per decoder layer."""

    model: tuple[Rule, ...]
    layer: tuple[Rule, ...]

    def model_rule(self, name: str) -> Rule | None:
        return next((r for r in self.model if r.megatron == name), None)

    def layer_rule(self, name: str) -> tuple[Rule, int | None] | None:
        """The rule for a name inside a decoder layer, and the local expert index it names."""
        for rule in self.layer:
            expert = rule.match(name)
            if expert is not False:
                return rule, expert
        return None


_LAYER = "model.layers.{i}."
_EMBEDDING = Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab", COLUMN)
_FINAL_NORM = Rule("decoder.final_layernorm.weight", ("model.norm.weight",))
_OUTPUT = Rule("output_layer.weight", ("lm_head.weight",), "vocab", COLUMN)
# With tied embeddings a pipeline's last stage keeps its own copy of the embedding as the output layer.
_TIED_OUTPUT = Rule("output_layer.weight", ("model.embed_tokens.weight",), "vocab", COLUMN, exported=False)


def _qkv(kind: str) -> Rule:
    return Rule(f"self_attention.linear_qkv.{kind}",
                tuple(f"{_LAYER}self_attn.{p}_proj.{kind}" for p in "qkv"), "qkv", COLUMN)


def _gated_mlp(megatron: str, hf: str) -> tuple[Rule, ...]:
    """A SwiGLU MLP: gate/up fused into linear_fc1 (column-parallel), down is linear_fc2 (row-parallel)."""
    return (Rule(f"{megatron}.linear_fc1.weight", (f"{hf}.gate_proj.weight", f"{hf}.up_proj.weight"), "gate_up",
                 COLUMN),
            Rule(f"{megatron}.linear_fc2.weight", (f"{hf}.down_proj.weight",), tp_dim=ROW))


_NORMS = (Rule("input_layernorm.weight", (f"{_LAYER}input_layernorm.weight",)),
          Rule("pre_mlp_layernorm.weight", (f"{_LAYER}post_attention_layernorm.weight",)))
_DENSE_MLP = _gated_mlp("mlp", f"{_LAYER}mlp")


def _attention(arch: Architecture, qkv_bias: bool) -> tuple[Rule, ...]:
    rules = [_qkv("weight"),
             Rule("self_attention.linear_proj.weight", (f"{_LAYER}self_attn.o_proj.weight",), tp_dim=ROW)]
    if qkv_bias:
        rules.append(_qkv("bias"))
    if arch.qk_layernorm:
        rules += [Rule("self_attention.q_layernorm.weight", (f"{_LAYER}self_attn.q_norm.weight",)),
                  Rule("self_attention.k_layernorm.weight", (f"{_LAYER}self_attn.k_norm.weight",))]
    return tuple(rules)


def _multi_latent_attention(hf_config) -> tuple[Rule, ...]:
    """DeepSeek MLA: every projection keeps its layout (per-head blocks), so each is a plain split copy."""
    attn = f"{_LAYER}self_attn."
    rules = [
        Rule("self_attention.linear_kv_down_proj.weight", (f"{attn}kv_a_proj_with_mqa.weight",), tp_dim=COLUMN),
        Rule("self_attention.kv_layernorm.weight", (f"{attn}kv_a_layernorm.weight",)),
        Rule("self_attention.linear_kv_up_proj.weight", (f"{attn}kv_b_proj.weight",), tp_dim=COLUMN),
        Rule("self_attention.linear_proj.weight", (f"{attn}o_proj.weight",), tp_dim=ROW),
    ]
    if hf_config.q_lora_rank:
        rules += [Rule("self_attention.linear_q_down_proj.weight", (f"{attn}q_a_proj.weight",), tp_dim=COLUMN),
                  Rule("self_attention.q_layernorm.weight", (f"{attn}q_a_layernorm.weight",)),
                  Rule("self_attention.linear_q_up_proj.weight", (f"{attn}q_b_proj.weight",), tp_dim=COLUMN)]
    else:
        rules.append(Rule("self_attention.linear_q_proj.weight", (f"{attn}q_proj.weight",), tp_dim=COLUMN))
    return tuple(rules)


def _mixture_of_experts() -> tuple[Rule, ...]:
    """DeepSeek-V3 MoE: router (+ its balance bias), per-expert SwiGLU experts, the shared experts."""
    return (Rule("mlp.router.weight", (f"{_LAYER}mlp.gate.weight",)),
            Rule("mlp.router.expert_bias", (f"{_LAYER}mlp.gate.e_score_correction_bias",)),
            *_gated_mlp("mlp.experts.local_experts.{e}", f"{_LAYER}mlp.experts.{{e}}"),
            *_gated_mlp("mlp.shared_experts", f"{_LAYER}mlp.shared_experts"))


def _qwen_mixture_of_experts(hf_config) -> tuple[Rule, ...]:
    """Qwen2/Qwen3-MoE: softmax router, per-expert SwiGLU experts; Qwen2-MoE adds a sigmoid-gated shared expert."""
    rules = (Rule("mlp.router.weight", (f"{_LAYER}mlp.gate.weight",)),
             *_gated_mlp("mlp.experts.local_experts.{e}", f"{_LAYER}mlp.experts.{{e}}"))
    if getattr(hf_config, "shared_expert_intermediate_size", None):
        rules += (*_gated_mlp("mlp.shared_experts", f"{_LAYER}mlp.shared_expert"),
                  Rule("mlp.shared_experts.gate_weight", (f"{_LAYER}mlp.shared_expert_gate.weight",)))
    return rules


def mapping_for(hf_config) -> MappingTable:
    """The table for this HF config (its model_type, biases, q/k norms, MLA, MoE, embedding tying)."""
    arch = architecture_for(hf_config)
    qkv_bias = getattr(hf_config, arch.qkv_bias, False) if isinstance(arch.qkv_bias, str) else arch.qkv_bias
    tied = bool(getattr(hf_config, "tie_word_embeddings", False))
    attention = _multi_latent_attention(hf_config) if arch.mla else _attention(arch, bool(qkv_bias))
    # MoE models keep dense MLPs in their first layers: both kinds of rules, each layer uses its own.
    if arch.moe == "qwen":
        experts = _qwen_mixture_of_experts(hf_config)
    else:
        experts = _mixture_of_experts() if arch.moe else ()
    mlp = _DENSE_MLP + experts
    return MappingTable(model=(_EMBEDDING, _FINAL_NORM, _TIED_OUTPUT if tied else _OUTPUT),
                        layer=_NORMS + attention + mlp)


# ----- Transformer-Engine spec names ------------------------------------------------------------------------
# The TE spec fuses a norm into the linear layer after it where that layer is a TE LayerNormLinear: the
# pre-attention norm into linear_qkv (not under MLA, whose latent norms fuse into its up-projections
# instead) and the pre-MLP norm into a dense linear_fc1 (an MoE layer's router needs the norm on its own).
_LAYER_NAME = re.compile(r"^(decoder\.layers\.\d+\.)(.+)$")


def _te_fusions(mla: bool, moe_layer: bool) -> dict[str, str]:
    fused = {}
    if mla:
        fused["self_attention.q_layernorm.weight"] = "self_attention.linear_q_up_proj.layer_norm_weight"
        fused["self_attention.kv_layernorm.weight"] = "self_attention.linear_kv_up_proj.layer_norm_weight"
    else:
        fused["input_layernorm.weight"] = "self_attention.linear_qkv.layer_norm_weight"
    if not moe_layer:
        fused["pre_mlp_layernorm.weight"] = "mlp.linear_fc1.layer_norm_weight"
    return fused


def _renamed(names: list[str], mla: bool, to_te: bool) -> dict[str, str]:
    moe_layers = {m.group(1) for m in map(_LAYER_NAME.match, names) if m and m.group(2) == "mlp.router.weight"}
    renamed = {}
    for name in names:
        match = _LAYER_NAME.match(name)
        if not match:
            renamed[name] = name
            continue
        table = _te_fusions(mla, match.group(1) in moe_layers)
        if not to_te:
            table = {te: local for local, te in table.items()}
        renamed[name] = match.group(1) + table.get(match.group(2), match.group(2))
    return renamed


def to_te_names(names: list[str], hf_config) -> dict[str, str]:
    """Local-spec parameter names of a model (all of them, or whole layers) → the Transformer-Engine spec's."""
    return _renamed(names, architecture_for(hf_config).mla, to_te=True)


def from_te_names(names: list[str], hf_config) -> dict[str, str]:
    """Transformer-Engine-spec parameter names → the local spec's (the table's own names)."""
    return _renamed(names, architecture_for(hf_config).mla, to_te=False)


def table_names(model, names: list[str]) -> dict[str, str]:
    """The names of a built GPTModel's parameters as the table writes them: the local spec's own, and a
    Transformer-Engine model's translated (its config's `transformer_impl` says which spec built it)."""
    if getattr(model.config, "transformer_impl", "local") != "transformer_engine":
        return {name: name for name in names}
    return _renamed(names, bool(model.config.multi_latent_attention), to_te=False)
