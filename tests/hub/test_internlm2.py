"""InternLM2 checkpoints resolve to a Llama conversion in the cache, built without running their code."""
from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from tiny_models import make_tiny_causal_lm, make_tiny_tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from twinkle_core.hashing import hash_tree
from twinkle_core.hub import HubError, resolve_model
from twinkle_core.hub.internlm2 import is_internlm2

HEADS, KV_HEADS, HIDDEN = 8, 2, 64
INTERNLM2_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
REMOTE_CODE = ("configuration_internlm2", "modeling_internlm2", "tokenization_internlm2", "tokenization_internlm2_fast")
_RENAMES = {  # Llama name part -> InternLM2 name part (q/k/v are packed separately)
    "model.embed_tokens.": "model.tok_embeddings.",
    "lm_head.": "output.",
    ".self_attn.o_proj.": ".attention.wo.",
    ".mlp.gate_proj.": ".feed_forward.w1.",
    ".mlp.up_proj.": ".feed_forward.w3.",
    ".mlp.down_proj.": ".feed_forward.w2.",
    ".input_layernorm.": ".attention_norm.",
    ".post_attention_layernorm.": ".ffn_norm.",
}


# --- a tiny InternLM2 checkpoint packed from a random tiny Llama -------------------------------------------


def pack_wqkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """InternLM2's fused layout: per kv head, [q rows of its query heads..., k rows, v rows]."""
    head_dim = k.shape[0] // kv_heads
    rest = q.shape[1:]
    q = q.reshape(kv_heads, -1, head_dim, *rest)  # query head g*group + i -> q[g, i]
    k = k.reshape(kv_heads, 1, head_dim, *rest)
    v = v.reshape(kv_heads, 1, head_dim, *rest)
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest)


def internlm2_state_dict(llama_state: dict[str, torch.Tensor], kv_heads: int, tied: bool) -> dict[str, torch.Tensor]:
    out = {}
    for name, tensor in llama_state.items():
        if tied and name == "lm_head.weight":
            continue  # a tied checkpoint saves the embeddings only
        if ".self_attn.q_proj." in name:
            prefix, kind = name.split(".self_attn.q_proj.")
            parts = [llama_state[f"{prefix}.self_attn.{p}_proj.{kind}"] for p in "qkv"]
            out[f"{prefix}.attention.wqkv.{kind}"] = pack_wqkv(*parts, kv_heads).clone()
            continue
        if ".self_attn.k_proj." in name or ".self_attn.v_proj." in name:
            continue
        for llama_part, internlm_part in _RENAMES.items():
            name = name.replace(llama_part, internlm_part)
        out[name] = tensor.clone()
    return out


def write_internlm2(folder: Path, model, tokenizer=None, shards: int = 1, drop: str | None = None, **config) -> Path:
    """An InternLM2-format directory (config, safetensors, tokenizer, remote code that must never run)."""
    folder.mkdir(parents=True)
    lc = model.config
    tensors = internlm2_state_dict(model.state_dict(), lc.num_key_value_heads, lc.tie_word_embeddings)
    tensors.pop(drop, None)
    names = sorted(tensors)
    if shards == 1:
        save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    else:
        weight_map = {}
        for i in range(shards):
            shard = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
            part = {name: tensors[name] for name in names[i::shards]}
            save_file(part, folder / shard, metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(part, shard))
        (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    rope = lc.rope_parameters
    cfg = {
        "architectures": ["InternLM2ForCausalLM"],
        "auto_map": {
            "AutoConfig": "configuration_internlm2.InternLM2Config",
            "AutoModel": "modeling_internlm2.InternLM2ForCausalLM",
            "AutoModelForCausalLM": "modeling_internlm2.InternLM2ForCausalLM",
        },
        "model_type": "internlm2", "attn_implementation": "eager", "torch_dtype": "float32",
        "bias": lc.attention_bias, "vocab_size": lc.vocab_size, "hidden_size": lc.hidden_size,
        "intermediate_size": lc.intermediate_size, "num_hidden_layers": lc.num_hidden_layers,
        "num_attention_heads": lc.num_attention_heads, "num_key_value_heads": lc.num_key_value_heads,
        "hidden_act": "silu", "max_position_embeddings": lc.max_position_embeddings, "rms_norm_eps": lc.rms_norm_eps,
        "rope_theta": rope["rope_theta"], "tie_word_embeddings": lc.tie_word_embeddings,
        "rope_scaling": None if rope["rope_type"] == "default" else {
            "type": rope["rope_type"], "factor": rope["factor"]},
        "bos_token_id": lc.bos_token_id, "eos_token_id": lc.eos_token_id, "pad_token_id": lc.pad_token_id,
    }
    (folder / "config.json").write_text(json.dumps({**cfg, **config}, indent=2))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [lc.eos_token_id, 4]}))
    for module in REMOTE_CODE:
        (folder / f"{module}.py").write_text("raise RuntimeError('InternLM2 remote code was executed')\n")
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
        settings = json.loads((folder / "tokenizer_config.json").read_text())
        settings.update(
            tokenizer_class="InternLM2Tokenizer", chat_template=INTERNLM2_TEMPLATE,
            auto_map={"AutoTokenizer": ["tokenization_internlm2.InternLM2Tokenizer",
                                        "tokenization_internlm2_fast.InternLM2TokenizerFast"]},
        )
        (folder / "tokenizer_config.json").write_text(json.dumps(settings, indent=2))
    return folder


def internlm2_tokenizer():
    return make_tiny_tokenizer(
        extra_special_tokens=["<|action_start|>", "<|action_end|>", "<|interpreter|>", "<|plugin|>"],
        chat_template=None, bos_token="<s>", eos_token="<|im_end|>", pad_token="</s>",
    )


def tiny_llama(tokenizer, **overrides):
    """A random 2-layer Llama, hidden 64, 8 query heads in 2 kv groups (so the wqkv grouping matters)."""
    config = dict(
        vocab_size=len(tokenizer), hidden_size=HIDDEN, intermediate_size=96, num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS, tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    model, _ = make_tiny_causal_lm("llama", **{**config, **overrides})
    return model.eval()


def _conversions(caplog) -> int:
    return sum("to the Llama layout (once)" in record.getMessage() for record in caplog.records)


def _remote_modules() -> list[str]:
    return [name for name in sys.modules if name.rsplit(".", 1)[-1] in REMOTE_CODE]


# --- tests ----------------------------------------------------------------------------------------------------


def test_packer_matches_internlm2_attention_unpacking():
    """The test packer reproduces what InternLM2's forward reads out of wqkv (so the round trip means something)."""
    model = tiny_llama(internlm2_tokenizer())
    attn = model.model.layers[0].self_attn
    wqkv = pack_wqkv(attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight, KV_HEADS)
    x = torch.randn(2, 5, HIDDEN)
    head_dim, group = HIDDEN // HEADS, HEADS // KV_HEADS
    # modeling_internlm2.InternLM2Attention.forward, verbatim shapes:
    qkv = (x @ wqkv.T).view(2, 5, KV_HEADS, group + 2, head_dim)
    q = qkv[..., :group, :].reshape(2, 5, HEADS, head_dim)
    k, v = qkv[..., -2, :], qkv[..., -1, :]
    with torch.no_grad():
        assert torch.equal(q, attn.q_proj(x).view(2, 5, HEADS, head_dim))
        assert torch.equal(k, attn.k_proj(x).view(2, 5, KV_HEADS, head_dim))
        assert torch.equal(v, attn.v_proj(x).view(2, 5, KV_HEADS, head_dim))
    # query head h uses kv head h // group, which is how Llama's repeat_kv pairs them
    assert [h // group for h in range(HEADS)] == [0, 0, 0, 0, 1, 1, 1, 1]


@pytest.mark.parametrize(
    "shards, overrides, seq_len",
    [
        (1, {}, 12),
        # sharded index, wqkv/wo biases, tied embeddings, dynamic NTK rope driven past max_position_embeddings
        (2, dict(attention_bias=True, tie_word_embeddings=True, max_position_embeddings=16,
                 rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}), 24),
        (1, dict(rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 500000.0}), 12),
    ],
    ids=["plain", "sharded-bias-tied-dynamic", "linear-rope"],
)
def test_internlm2_resolves_to_an_equivalent_llama(tmp_path, isolated_caches, caplog, shards, overrides, seq_len):
    caplog.set_level(logging.INFO, logger="twinkle_core.hub")
    tokenizer = internlm2_tokenizer()
    llama = tiny_llama(tokenizer, **overrides)
    source = write_internlm2(tmp_path / "internlm2", llama, tokenizer, shards=shards)
    assert is_internlm2(source)

    resolved = resolve_model(str(source))
    assert resolved.content_hash == hash_tree(source)
    assert resolved.path.parent == isolated_caches["twinkle"] / "models"
    assert not is_internlm2(resolved.path) and not list(resolved.path.glob("*.py"))
    assert (resolved.path / "model.safetensors.index.json").is_file() == (shards > 1)
    converted = AutoModelForCausalLM.from_pretrained(resolved.path).eval()  # no trust_remote_code
    assert type(converted).__name__ == "LlamaForCausalLM"
    state = converted.state_dict()
    for name, tensor in llama.state_dict().items():
        assert torch.equal(state[name], tensor), name
    ids = torch.randint(0, len(tokenizer), (2, seq_len), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(converted(ids).logits, llama(ids).logits, rtol=0, atol=1e-6)

    assert GenerationConfig.from_pretrained(resolved.path).eos_token_id == [tokenizer.eos_token_id, 4]
    assert _remote_modules() == []
    assert not list(isolated_caches["hf_home"].rglob("*internlm2*.py"))  # nothing copied into HF_MODULES_CACHE
    assert _conversions(caplog) == 1
    again = resolve_model(f"file://{source}")
    assert again.path == resolved.path and again.content_hash == resolved.content_hash
    assert _conversions(caplog) == 1  # reused, not converted again


def test_converted_tokenizer_keeps_ids_specials_and_chat_template(tmp_path, isolated_caches):
    tokenizer = internlm2_tokenizer()
    source = write_internlm2(tmp_path / "internlm2", tiny_llama(tokenizer), tokenizer)
    converted = AutoTokenizer.from_pretrained(resolve_model(str(source)).path)
    text = "<|im_start|>user\nWho are you?<|im_end|>\n<|action_start|><|plugin|>\n"
    assert converted(text)["input_ids"] == tokenizer(text)["input_ids"]
    assert (converted.bos_token, converted.eos_token, converted.pad_token) == ("<s>", "<|im_end|>", "</s>")
    assert converted.chat_template == INTERNLM2_TEMPLATE
    chat = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"}]
    rendered = converted.apply_chat_template(chat, tokenize=False)
    assert rendered == "<s><|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\nhi<|im_end|>\n"
    settings = json.loads((resolve_model(str(source)).path / "tokenizer_config.json").read_text())
    assert "auto_map" not in settings and settings["tokenizer_class"] != "InternLM2Tokenizer"
    assert _remote_modules() == []


# --- the SentencePiece path: tokenizer.model only, as the real InternLM 2.5 repos ship -----------------------

# (piece, score) of the normal pieces; merges follow the scores, so ▁hello, ▁world and ▁user are reachable.
_SPM_PIECES = [(c, -float(i)) for i, c in enumerate("▁helowrdus", start=1)] + [
    ("ll", -11.0), ("he", -12.0), ("llo", -13.0), ("hello", -14.0), ("▁hello", -15.0), ("or", -16.0),
    ("wor", -17.0), ("worl", -18.0), ("world", -19.0), ("▁world", -20.0), ("us", -21.0), ("er", -22.0),
    ("user", -23.0), ("▁user", -24.0),
]
_SPECIALS = ["<|plugin|>", "<|interpreter|>", "<|action_end|>", "<|action_start|>", "<|im_end|>", "<|im_start|>"]


def write_sentencepiece_model(path: Path) -> list[str]:
    """A BPE SentencePiece model like InternLM2's: byte fallback, dummy prefix, [UNUSED_TOKEN_*] slots at the end."""
    from transformers.convert_slow_tokenizer import import_protobuf

    proto = import_protobuf().ModelProto()
    spec = proto.trainer_spec
    spec.model_type, spec.byte_fallback, spec.vocab_size = 2, True, 0
    spec.unk_id, spec.bos_id, spec.eos_id, spec.pad_id = 0, 1, 2, -1
    spec.unk_piece, spec.bos_piece, spec.eos_piece = "<unk>", "<s>", "</s>"
    norm = proto.normalizer_spec
    norm.name, norm.add_dummy_prefix, norm.remove_extra_whitespaces, norm.escape_whitespaces = (
        "identity", True, False, True,
    )
    pieces = [("<unk>", 0.0, 2), ("<s>", 0.0, 3), ("</s>", 0.0, 3)]
    pieces += [(f"<0x{b:02X}>", 0.0, 6) for b in range(256)]
    pieces += [(piece, score, 1) for piece, score in _SPM_PIECES]
    pieces += [(f"[UNUSED_TOKEN_{141 + i}]", 0.0, 4) for i in range(len(_SPECIALS))]
    for piece, score, kind in pieces:
        proto.pieces.add(piece=piece, score=score, type=kind)
    path.write_bytes(proto.SerializeToString())
    return [piece for piece, _, _ in pieces]


def write_sentencepiece_tokenizer(folder: Path) -> list[str]:
    pieces = write_sentencepiece_model(folder / "tokenizer.model")
    first = len(pieces) - len(_SPECIALS)
    token = dict(lstrip=False, rstrip=False, normalized=False, single_word=False, special=True)
    added = {str(i): {"content": piece, **token} for i, piece in enumerate(pieces[:3])}
    added |= {str(first + i): {"content": special, **token} for i, special in enumerate(_SPECIALS)}
    settings = {
        "auto_map": {"AutoTokenizer": ["tokenization_internlm2.InternLM2Tokenizer",
                                       "tokenization_internlm2_fast.InternLM2TokenizerFast"]},
        "tokenizer_class": "InternLM2Tokenizer", "added_tokens_decoder": added,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>", "<|action_start|>", "<|action_end|>",
                                      "<|interpreter|>", "<|plugin|>"],
        "bos_token": "<s>", "eos_token": "</s>", "pad_token": "</s>", "unk_token": "<unk>",
        "clean_up_tokenization_spaces": False, "decode_with_prefix_space": False, "chat_template": INTERNLM2_TEMPLATE,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(settings, indent=2))
    return pieces[:first] + _SPECIALS


def test_sentencepiece_tokenizer_is_converted_without_sentencepiece(tmp_path, isolated_caches):
    source = tmp_path / "internlm2"
    vocab_size = 3 + 256 + len(_SPM_PIECES) + len(_SPECIALS)
    write_internlm2(source, tiny_llama(internlm2_tokenizer(), vocab_size=vocab_size, bos_token_id=1,
                                       eos_token_id=2, pad_token_id=2))
    names = write_sentencepiece_tokenizer(source)
    converted = AutoTokenizer.from_pretrained(resolve_model(str(source)).path)
    assert converted.convert_ids_to_tokens(list(range(len(names)))) == names

    def ids(*tokens):
        return converted.convert_tokens_to_ids(list(tokens))

    assert converted("hello world")["input_ids"] == ids("<s>", "▁hello", "▁world")  # add_bos_token as InternLM2
    assert converted("hello  world", add_special_tokens=False)["input_ids"] == ids("▁hello", "▁", "▁world")
    # special tokens whole; every chunk between them gets the dummy prefix; "\n" and "é" fall back to bytes
    text = "<|im_start|>user\nhello<|im_end|>é"
    assert converted(text, add_special_tokens=False)["input_ids"] == ids(
        "<|im_start|>", "▁user", "<0x0A>", "hello", "<|im_end|>", "▁", "<0xC3>", "<0xA9>",
    )
    assert converted.decode(converted("hello world é\n")["input_ids"], skip_special_tokens=True) == "hello world é\n"
    assert converted.eos_token == "</s>" and converted.pad_token == "</s>"
    assert converted.chat_template == INTERNLM2_TEMPLATE
    assert _remote_modules() == []


# --- broken checkpoints fail clearly and leave nothing behind ----------------------------------------------


@pytest.mark.parametrize(
    "broken, match",
    [
        (dict(drop="model.layers.1.attention.wqkv.weight"),
         r"tensors are missing.*model\.layers\.1\.self_attn\.k_proj"),
        (dict(num_key_value_heads=3), r"num_attention_heads=8 is not divisible by num_key_value_heads=3"),
        (dict(num_key_value_heads=4), r"wqkv\.weight has 96 rows but num_key_value_heads=4"),
        (dict(num_hidden_layers=1), r"tensor 'model\.layers\.1\..* has no place"),
        (dict(rope_scaling={"type": "yarn", "factor": 2.0}), r"rope_scaling=.*yarn.* is not supported"),
        (dict(vocab_size=None), r"config\.json lacks \['vocab_size'\]"),  # null counts as absent
    ],
    ids=["missing-tensor", "heads-not-divisible", "kv-heads-mismatch", "extra-layer", "rope-yarn", "no-vocab"],
)
def test_broken_checkpoint_fails_clearly_and_caches_nothing(tmp_path, isolated_caches, broken, match):
    tokenizer = internlm2_tokenizer()
    source = write_internlm2(tmp_path / "internlm2", tiny_llama(tokenizer), tokenizer, **broken)
    with pytest.raises(HubError, match=match):
        resolve_model(str(source))
    assert list((isolated_caches["twinkle"] / "models").iterdir()) == []
