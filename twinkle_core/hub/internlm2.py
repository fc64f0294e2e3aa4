"""InternLM2 / InternLM 2.5 checkpoints, converted once into plain Llama checkpoints without running their code.

InternLM2 repos (config.json `model_type: "internlm2"`) ship their own modelling and tokenizer code behind
`auto_map`, and transformers has no class of its own for them. The architecture is Llama's (RMSNorm, SwiGLU,
RoPE with optional linear or dynamic-NTK scaling, GQA) with other tensor names and a fused `wqkv`, so
`resolve_model` converts such a directory once into a Llama directory in the cache, keyed by the source's
content hash, and returns that directory instead.

Converting is the default and the only path: no Python file of the repo is imported or executed, so
`trust_remote_code=True` in `TransformersModel(**from_pretrained_kwargs)` is not needed (passing it is harmless:
the converted config has no `auto_map`). Loading InternLM's original code is deliberately not implemented; who
prefers it can load the source snapshot with transformers directly, outside Twinkle.
"""
from __future__ import annotations

import json
import logging
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from twinkle_core.hub.convert_shards import Conversion, converted_once, write_converted
from twinkle_core.paths import cache_dir

from .errors import HubError

log = logging.getLogger(__name__)

# Part of the cache key: bump it when the converted layout changes, so old conversions are not reused.
_LAYOUT_VERSION = 2

# InternLM2Config's own defaults, for fields a config.json leaves out (they differ from Llama's: bias=True).
_DEFAULTS = {
    "hidden_act": "silu", "max_position_embeddings": 2048, "initializer_range": 0.02, "rms_norm_eps": 1e-6,
    "use_cache": True, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False,
    "bias": True, "rope_theta": 10000.0, "rope_scaling": None,
}
_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")

_LAYER = r"(model\.layers\.\d+)"
_RENAMES = [(re.compile(pattern), replacement) for pattern, replacement in (
    (r"model\.tok_embeddings\.weight", "model.embed_tokens.weight"),
    (r"model\.norm\.weight", "model.norm.weight"),
    (r"output\.weight", "lm_head.weight"),
    (_LAYER + r"\.attention\.wo\.(weight|bias)", r"\1.self_attn.o_proj.\2"),
    (_LAYER + r"\.feed_forward\.w1\.(weight|bias)", r"\1.mlp.gate_proj.\2"),
    (_LAYER + r"\.feed_forward\.w3\.(weight|bias)", r"\1.mlp.up_proj.\2"),
    (_LAYER + r"\.feed_forward\.w2\.(weight|bias)", r"\1.mlp.down_proj.\2"),
    (_LAYER + r"\.attention_norm\.weight", r"\1.input_layernorm.weight"),
    (_LAYER + r"\.ffn_norm\.weight", r"\1.post_attention_layernorm.weight"),
)]
_WQKV = re.compile(_LAYER + r"\.attention\.wqkv\.(weight|bias)")
_ROTARY_BUFFER = re.compile(r".*\.rotary_emb\.inv_freq")  # saved by some old checkpoints; Llama recomputes it

# tokenizer_config.json keys that only InternLM2's own tokenizer classes understand.
_TOKENIZER_CODE_KEYS = ("auto_map", "tokenizer_class", "sp_model_kwargs", "decode_with_prefix_space", "vocab_file")
_TOKENIZER_SIDE_FILES = ("special_tokens_map.json", "chat_template.jinja")


@dataclass(frozen=True)
class _Heads:
    num_heads: int
    num_kv_heads: int
    head_dim: int

    @property
    def group(self) -> int:
        return self.num_heads // self.num_kv_heads


def is_internlm2(path: str | Path) -> bool:
    """True when `path` is a model directory whose config.json declares `model_type: "internlm2"`."""
    config = Path(path) / "config.json"
    return config.is_file() and _read_json(config).get("model_type") == "internlm2"


def materialise_internlm2(src: Path, content_hash: str) -> Path:
    """The Llama directory converted from InternLM2 checkpoint `src`; written on first use only."""
    final = cache_dir("models") / f"internlm2-llama-v{_LAYOUT_VERSION}-{content_hash[:16]}"
    return converted_once(src, final, INTERNLM2, "the Llama layout", convert_internlm2_to_llama)


def convert_internlm2_to_llama(src: str | Path, dst: str | Path) -> None:
    """Write a Llama checkpoint (config, safetensors shards, fast tokenizer) equivalent to InternLM2 `src`."""
    src, dst = Path(src), Path(dst)
    config = _llama_config(_read_json(src / "config.json"), src)
    dst.mkdir(parents=True, exist_ok=True)
    _convert_weights(src, dst, config)
    config.save_pretrained(dst)
    _convert_tokenizer(src, dst)
    if (src / "generation_config.json").is_file():  # InternLM 2.5 stops on <|im_end|> (92542) as well as </s>
        shutil.copyfile(src / "generation_config.json", dst / "generation_config.json")


# --- config -------------------------------------------------------------------------------------------------


def _llama_config(source: dict, src: Path):
    from transformers import LlamaConfig

    cfg = {**_DEFAULTS, **{key: value for key, value in source.items() if value is not None}}
    missing = [field for field in _REQUIRED if field not in cfg]
    if missing:
        raise HubError(
            f"InternLM2 checkpoint {str(src)!r}: config.json lacks {missing}; add them (see InternLM2Config)"
        )
    heads = _heads(cfg, src)
    extra = {"dtype": cfg["torch_dtype"]} if "torch_dtype" in cfg else {}
    return LlamaConfig(
        architectures=["LlamaForCausalLM"],
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_hidden_layers=cfg["num_hidden_layers"],
        num_attention_heads=heads.num_heads,
        num_key_value_heads=heads.num_kv_heads,
        head_dim=heads.head_dim,
        hidden_act=cfg["hidden_act"],
        max_position_embeddings=cfg["max_position_embeddings"],
        initializer_range=cfg["initializer_range"],
        rms_norm_eps=cfg["rms_norm_eps"],
        use_cache=cfg["use_cache"],
        pad_token_id=cfg["pad_token_id"],
        bos_token_id=cfg["bos_token_id"],
        eos_token_id=cfg["eos_token_id"],
        tie_word_embeddings=cfg["tie_word_embeddings"],
        rope_parameters=_rope_parameters(cfg, src),
        attention_bias=bool(cfg["bias"]),  # InternLM2's `bias` covers wqkv and wo only
        mlp_bias=False,  # its feed-forward layers never have a bias
        # The Llama layout hides where the checkpoint came from; the family registry reads this key.
        twinkle_source_family="internlm2_5",
        **extra,
    )


def _heads(cfg: dict, src: Path) -> _Heads:
    hidden, num_heads = cfg["hidden_size"], cfg["num_attention_heads"]
    num_kv_heads = cfg.get("num_key_value_heads") or num_heads
    if hidden % num_heads:
        raise HubError(
            f"InternLM2 checkpoint {str(src)!r}: hidden_size={hidden} is not divisible by "
            f"num_attention_heads={num_heads}; fix config.json"
        )
    if num_heads % num_kv_heads:
        raise HubError(
            f"InternLM2 checkpoint {str(src)!r}: num_attention_heads={num_heads} is not divisible by "
            f"num_key_value_heads={num_kv_heads}; fix config.json"
        )
    return _Heads(num_heads, num_kv_heads, hidden // num_heads)


def _rope_parameters(cfg: dict, src: Path) -> dict:
    theta = float(cfg["rope_theta"])
    scaling = cfg["rope_scaling"]
    if not scaling:
        return {"rope_type": "default", "rope_theta": theta}
    kind = scaling.get("type") or scaling.get("rope_type")
    factor = scaling.get("factor")
    # InternLM2's 'linear' (positions / factor) and 'dynamic' (NTK base growth past max_position_embeddings)
    # use the same formulas as Llama's rope types of the same name; its code accepts no other kind.
    if kind not in ("linear", "dynamic") or not isinstance(factor, (int, float)) or factor < 1:
        raise HubError(
            f"InternLM2 checkpoint {str(src)!r}: rope_scaling={scaling!r} is not supported; "
            "InternLM2 defines only {'type': 'linear' or 'dynamic', 'factor': >= 1}"
        )
    return {"rope_type": kind, "factor": float(factor), "rope_theta": theta}


# --- weights ------------------------------------------------------------------------------------------------


INTERNLM2 = Conversion("InternLM2 checkpoint", "a Llama model", "check `bias` and the layer count in config.json",
                       "Llama names; q/k/v_proj come from attention.wqkv; the download is incomplete or not InternLM2")


def _convert_weights(src: Path, dst: Path, config) -> None:
    """Rename and split tensors shard by shard, so peak memory stays near one source shard."""
    from transformers import LlamaForCausalLM

    heads = _Heads(config.num_attention_heads, config.num_key_value_heads, config.head_dim)
    write_converted(src, dst, LlamaForCausalLM, config, lambda name, tensor: _converted(name, tensor, heads, src),
                    INTERNLM2)


def _converted(name: str, tensor, heads: _Heads, src: Path) -> list[tuple[str, object]]:
    """The Llama (name, tensor) pairs for one InternLM2 tensor."""
    if _ROTARY_BUFFER.fullmatch(name):
        return []
    match = _WQKV.fullmatch(name)
    if match:
        layer, kind = match.groups()
        q, k, v = _split_wqkv(tensor, heads, name, src)
        return [(f"{layer}.self_attn.{proj}_proj.{kind}", part) for proj, part in zip("qkv", (q, k, v))]
    for pattern, replacement in _RENAMES:
        if pattern.fullmatch(name):
            return [(pattern.sub(replacement, name), tensor)]
    raise HubError(f"InternLM2 checkpoint {str(src)!r}: tensor {name!r} is not part of the InternLM2 layout")


def _split_wqkv(wqkv, heads: _Heads, name: str, src: Path):
    """Undo the fusion exactly as InternLM2's attention unpacks it.

    Its forward does `qkv.view(b, s, num_kv_heads, group + 2, head_dim)`, q = [..., :group, :] flattened
    (so query head h*group + i is slot i of kv group h), k = [..., -2, :], v = [..., -1, :]: the output rows
    are laid out per kv head as [that group's q heads..., k, v].
    """
    import torch

    rows = heads.num_kv_heads * (heads.group + 2) * heads.head_dim
    if wqkv.shape[0] != rows:
        raise HubError(
            f"InternLM2 checkpoint {str(src)!r}: {name} has {wqkv.shape[0]} rows but num_key_value_heads="
            f"{heads.num_kv_heads}, num_attention_heads={heads.num_heads}, head_dim={heads.head_dim} need {rows}; "
            "config.json does not match the weights"
        )
    rest = tuple(wqkv.shape[1:])
    grouped = wqkv.reshape(heads.num_kv_heads, heads.group + 2, heads.head_dim, *rest)
    q = grouped[:, : heads.group].reshape(heads.num_heads * heads.head_dim, *rest)
    k = grouped[:, -2].reshape(heads.num_kv_heads * heads.head_dim, *rest)
    v = grouped[:, -1].reshape(heads.num_kv_heads * heads.head_dim, *rest)
    # Own contiguous copies: safetensors refuses tensors that share storage (views of one wqkv can).
    return tuple(part.clone(memory_format=torch.contiguous_format) for part in (q, k, v))


# --- tokenizer ----------------------------------------------------------------------------------------------


def _convert_tokenizer(src: Path, dst: Path) -> None:
    """Save a plain fast tokenizer: InternLM2's tokenizer.json, or one converted from its SentencePiece model."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    settings = _read_json(src / "tokenizer_config.json") if (src / "tokenizer_config.json").is_file() else {}
    settings = {key: value for key, value in settings.items() if key not in _TOKENIZER_CODE_KEYS}
    with tempfile.TemporaryDirectory(prefix="internlm2-tokenizer-") as staging:
        staged = Path(staging)
        if (src / "tokenizer.json").is_file():
            shutil.copyfile(src / "tokenizer.json", staged / "tokenizer.json")
        elif (src / "tokenizer.model").is_file():
            _sentencepiece_tokenizer(src, settings).save(str(staged / "tokenizer.json"))
        else:
            raise HubError(
                f"InternLM2 checkpoint {str(src)!r}: no tokenizer.json or tokenizer.model; download the tokenizer files"
            )
        (staged / "tokenizer_config.json").write_text(json.dumps(settings, indent=2))
        for name in _TOKENIZER_SIDE_FILES:
            if (src / name).is_file():
                shutil.copyfile(src / name, staged / name)
        # The generic fast class loads tokenizer.json as is; no InternLM2 tokenizer class is looked up.
        tokenizer = PreTrainedTokenizerFast.from_pretrained(staged)
    tokenizer.save_pretrained(dst)
    if AutoTokenizer.from_pretrained(dst).chat_template != tokenizer.chat_template:
        raise HubError(f"the chat template of InternLM2 checkpoint {str(src)!r} was lost when saving its tokenizer")


def _sentencepiece_tokenizer(src: Path, settings: dict):
    """A `tokenizers.Tokenizer` from tokenizer.model, using transformers' own SentencePiece converter.

    Only `protobuf` is needed (not `sentencepiece`). As in InternLM2's converter, pieces named in
    `added_tokens_decoder` (e.g. its [UNUSED_TOKEN_*] slots holding <|im_start|>) take those names and
    become special tokens; each chunk between special tokens gets SentencePiece's dummy prefix ("legacy").
    """
    from tokenizers import AddedToken
    from transformers.convert_slow_tokenizer import SpmConverter, import_protobuf

    try:
        model_pb2 = import_protobuf()
    except ImportError as exc:
        raise HubError(
            f"InternLM2 checkpoint {str(src)!r}: reading its tokenizer.model needs the 'protobuf' package; "
            "install it with `pip install protobuf`"
        ) from exc
    from google.protobuf.message import DecodeError

    proto = model_pb2.ModelProto()
    try:
        proto.ParseFromString((src / "tokenizer.model").read_bytes())
    except DecodeError as exc:
        raise HubError(
            f"InternLM2 checkpoint {str(src)!r}: tokenizer.model is not a SentencePiece model ({exc}); "
            "download it again"
        ) from exc
    if proto.trainer_spec.model_type != 2:  # 2 = BPE
        raise HubError(
            f"InternLM2 checkpoint {str(src)!r}: tokenizer.model is SentencePiece model_type="
            f"{proto.trainer_spec.model_type}, but InternLM2 uses BPE (2); it is not an InternLM2 tokenizer"
        )
    added = {int(i): token for i, token in (settings.get("added_tokens_decoder") or {}).items()}
    vocab = {added.get(i, {}).get("content", piece.piece): i for i, piece in enumerate(proto.pieces)}
    if len(vocab) != len(proto.pieces):
        raise HubError(
            f"InternLM2 checkpoint {str(src)!r}: added_tokens_decoder in tokenizer_config.json renames a piece "
            "to a name another piece already has; fix tokenizer_config.json"
        )
    tokenizer = SpmConverter.build_tokenizer_from_spm_proto(proto=proto, vocab=vocab, legacy=True)
    tokenizer.post_processor = _bos_eos_processor(settings, vocab, src)
    tokenizer.add_special_tokens([
        AddedToken(
            token["content"], special=token.get("special", True), normalized=token.get("normalized", False),
            lstrip=token.get("lstrip", False), rstrip=token.get("rstrip", False),
            single_word=token.get("single_word", False),
        )
        for _, token in sorted(added.items())
    ])
    return tokenizer


def _bos_eos_processor(settings: dict, vocab: dict[str, int], src: Path):
    """InternLM2TokenizerFast's post-processor: <s> first (add_bos_token, default on), </s> last if add_eos_token.

    transformers 5 ignores add_bos_token next to a tokenizer.json, so the tokenizer.json itself must carry it.
    """
    from tokenizers import processors

    ends = {}
    for end, default, enabled in (("bos", "<s>", True), ("eos", "</s>", False)):
        if settings.get(f"add_{end}_token", enabled):
            token = settings.get(f"{end}_token") or default
            ends[end] = token["content"] if isinstance(token, dict) else token
            if ends[end] not in vocab:
                raise HubError(
                    f"InternLM2 checkpoint {str(src)!r}: {end}_token={ends[end]!r} of tokenizer_config.json is not "
                    "a piece of tokenizer.model; fix tokenizer_config.json"
                )
    def sequence(part: str, type_id: int) -> list[str]:
        return [f"{piece}:{type_id}" for piece in (ends.get("bos"), f"${part}", ends.get("eos")) if piece]

    single = sequence("A", 0)
    return processors.TemplateProcessing(
        single=single, pair=single + sequence("B", 1),
        special_tokens=[(token, vocab[token]) for token in ends.values()],
    )


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise HubError(f"{str(path)!r} could not be read as JSON: {exc}; download it again") from exc
