"""Write a Llama-family Hugging Face model (weights, tokenizer, chat template) as one F32 GGUF file.

llama.cpp, Ollama and transformers (`from_pretrained(dir, gguf_file=...)`) read it. Only the `llama`
GGUF architecture is written (model types llama and mistral without sliding windows, biases or rope
scaling); other models are refused with the reason, since each GGUF architecture has its own tensor
layout. q and k rows are reordered from Hugging Face's rotate-half rotary layout to the interleaved one
GGUF readers expect.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from twinkle_core.errors import UserError

LLAMA_FAMILY = ("llama", "mistral")
CONTROL, NORMAL = 3, 1  # GGUF token types


class GgufExportError(UserError):
    """The model cannot be written as GGUF by this exporter (the message says why and what to do)."""


def gguf_problems(config) -> list[str]:
    """Why `config` cannot be written as a `llama` GGUF (empty when it can)."""
    model_type = getattr(config, "model_type", None)
    if model_type not in LLAMA_FAMILY:
        return [f"model_type {model_type!r} is not a Llama-family architecture ({', '.join(LLAMA_FAMILY)}); "
                "export --to hf-merged and convert that folder with llama.cpp's convert_hf_to_gguf.py"]
    problems = []
    if getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False):
        problems.append("the model has attention or MLP biases, which the llama GGUF layout has no tensors for")
    if getattr(config, "sliding_window", None):
        problems.append(f"sliding_window={config.sliding_window}: the llama GGUF layout has no sliding window")
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if rope.get("rope_type", "default") != "default":
        problems.append(f"rope_type {rope['rope_type']!r}: only unscaled rotary embeddings are written")
    return problems


def _rope_theta(config) -> float:
    rope = getattr(config, "rope_parameters", None) or {}
    return float(rope.get("rope_theta") or getattr(config, "rope_theta", 10000.0))


def _interleave_rotary(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Each head's rows [first halves..., second halves...] -> pairs (x0, x_half, x1, x_half+1, ...)."""
    rows, cols = weight.shape
    return weight.reshape(heads, 2, rows // heads // 2, cols).transpose(1, 2).reshape(rows, cols)


def _tensors(model, config) -> dict[str, torch.Tensor]:
    """GGUF tensor name -> fp32 weight, from a LlamaForCausalLM-shaped state dict."""
    state = {k: v.detach().to(torch.float32) for k, v in model.state_dict().items()}
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads or config.num_attention_heads
    out = {"token_embd.weight": state["model.embed_tokens.weight"], "output_norm.weight": state["model.norm.weight"]}
    if not config.tie_word_embeddings:
        out["output.weight"] = state["lm_head.weight"]
    names = {"input_layernorm": "attn_norm", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down"}
    for layer in range(config.num_hidden_layers):
        prefix = f"model.layers.{layer}."
        for hf_name, gguf_name in names.items():
            out[f"blk.{layer}.{gguf_name}.weight"] = state[f"{prefix}{hf_name}.weight"]
        out[f"blk.{layer}.attn_q.weight"] = _interleave_rotary(state[f"{prefix}self_attn.q_proj.weight"], heads)
        out[f"blk.{layer}.attn_k.weight"] = _interleave_rotary(state[f"{prefix}self_attn.k_proj.weight"], kv_heads)
    return out


def _add_tokenizer(writer, tokenizer, vocab_size: int) -> None:
    """A byte-level BPE tokenizer (the `gpt2` GGUF tokenizer model) with its special tokens and template."""
    backend = json.loads(tokenizer.backend_tokenizer.to_str())
    if backend["model"]["type"] != "BPE":
        raise GgufExportError(f"the tokenizer is {backend['model']['type']}, not byte-level BPE: write it with "
                              "llama.cpp's convert_hf_to_gguf.py from an hf-merged export")
    special = set(tokenizer.all_special_ids) | {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    tokens += [f"[PAD{i}]" for i in range(len(tokens), vocab_size)]  # embedding rows past the tokenizer
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([CONTROL if i in special or i >= len(tokenizer) else NORMAL for i in range(len(tokens))])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in backend["model"]["merges"]])
    for token, add in (("bos", writer.add_bos_token_id), ("eos", writer.add_eos_token_id),
                       ("pad", writer.add_pad_token_id)):
        token_id = getattr(tokenizer, f"{token}_token_id")
        if token_id is not None:
            add(token_id)
    writer.add_add_bos_token(False)  # the chat template writes every special token itself
    if tokenizer.chat_template:
        writer.add_chat_template(tokenizer.chat_template)


def write_gguf(model, tokenizer, path: str | Path, name: str = "twinkle") -> Path:
    """`model` (a transformers Llama-family causal LM, not a PeftModel) and `tokenizer` as an F32 GGUF file."""
    import gguf

    config = model.config
    problems = gguf_problems(config)
    if problems:
        raise GgufExportError("cannot write GGUF: " + "; ".join(problems))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(path), "llama")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_name(name)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads or config.num_attention_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(_rope_theta(config))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    _add_tokenizer(writer, tokenizer, config.vocab_size)
    for tensor_name, weight in _tensors(model, config).items():
        writer.add_tensor(tensor_name, weight.contiguous().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
