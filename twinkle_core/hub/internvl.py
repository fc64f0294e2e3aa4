"""Original (remote-code) InternVL checkpoints, converted once into transformers' native `internvl` layout.

OpenGVLab's InternVL 2 / 2.5 repos (config.json `model_type: "internvl_chat"`, `architectures:
["InternVLChatModel"]`, with `llm_config` and `vision_config`) ship their own modelling code behind `auto_map`.
Transformers has the same architecture built in as `internvl` (the `-hf` repos). `resolve_model` converts such
a directory once into the native layout in the cache, keyed by the source's content hash, and returns that
directory: no Python file of the repo is imported or executed.

What changes (the mapping follows transformers' own conversion script, re-derived here):
- the vision tower (InternViT, `vision_model.*`) becomes `model.vision_tower.*`: `encoder.layers` ->
  `encoder.layer`, the fused `attn.qkv` is split into thirds (q, k, v), `attn.proj` -> `attention.
  projection_layer`, `norm1/norm2` -> `layernorm_before/after`, `ls1/ls2` -> `lambda_1/2`, the embeddings'
  `class_embedding`, `patch_embedding`, `position_embedding` -> `cls_token`, `patch_embeddings.projection`,
  `position_embeddings`;
- the projector `mlp1.{0,1,3}` -> `model.multi_modal_projector.{layer_norm,linear_1,linear_2}`;
- the language model `language_model.*` -> `model.language_model.*` and `lm_head`. An InternLM2 language
  model (InternVL2_5-8B, -26B) becomes a Llama text model exactly as internlm2.py converts InternLM2 (split
  `wqkv`, renamed `w1/w3/w2`); Qwen2 and Llama language models keep their names.
- the image processor settings (tile size, min/max tiles) go into preprocessor_config.json for transformers'
  GotOcr2 image processor, and `image_token_id` is the tokenizer's `<IMG_CONTEXT>`;
- as in the `-hf` checkpoints, the tokenizer names its media tokens (`start_image_token`, ...) and
  processor_config.json gives the context tokens per tile, so `AutoProcessor.from_pretrained` (and vLLM)
  open the folder with transformers' own InternVLProcessor.
"""
from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path

from twinkle_core.hub.convert_shards import Conversion, converted_once, write_converted
from twinkle_core.paths import cache_dir

from . import internlm2
from .errors import HubError

log = logging.getLogger(__name__)

# Part of the cache key: bump it when the converted layout changes, so old conversions are not reused.
_LAYOUT_VERSION = 2  # 2: the tokenizer names its media tokens and processor_config.json is written

IMAGE_CONTEXT_TOKEN = "<IMG_CONTEXT>"
# The tokenizer attributes transformers' InternVLProcessor reads (`AutoProcessor`, and vLLM through it), named
# as in the `-hf` checkpoints. The image tokens exist in every InternVL tokenizer; `<video>` is added, as the
# `-hf` conversion adds it (this project trains InternVL on images only).
NAMED_TOKENS = {"start_image_token": "<img>", "end_image_token": "</img>", "context_image_token": IMAGE_CONTEXT_TOKEN,
                "video_token": "<video>"}
_IMAGENET_MEAN, _IMAGENET_STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]

# Language models the conversion knows, by the llm_config's architecture.
_INTERNLM2, _PLAIN = ("InternLM2ForCausalLM",), ("Qwen2ForCausalLM", "LlamaForCausalLM")
SUPPORTED_LLMS = _INTERNLM2 + _PLAIN
# Keys of a remote-code llm_config that only its own code reads, or that the native config sets itself.
_LLM_CODE_KEYS = ("auto_map", "architectures", "_name_or_path", "transformers_version", "attn_implementation",
                  "use_flash_attn", "torch_dtype")

_VISION_REQUIRED = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")

_VISION_LAYER = r"vision_model\.encoder\.layers\.(\d+)\."
_VISION_RENAMES = [(re.compile(pattern), replacement) for pattern, replacement in (
    (r"vision_model\.embeddings\.class_embedding", "model.vision_tower.embeddings.cls_token"),
    (r"vision_model\.embeddings\.position_embedding", "model.vision_tower.embeddings.position_embeddings"),
    (r"vision_model\.embeddings\.patch_embedding\.(weight|bias)",
     r"model.vision_tower.embeddings.patch_embeddings.projection.\1"),
    (_VISION_LAYER + r"attn\.proj\.(weight|bias)",
     r"model.vision_tower.encoder.layer.\1.attention.projection_layer.\2"),
    (_VISION_LAYER + r"attn\.(q|k)_norm\.(weight|bias)", r"model.vision_tower.encoder.layer.\1.attention.\2_norm.\3"),
    (_VISION_LAYER + r"ls1", r"model.vision_tower.encoder.layer.\1.lambda_1"),
    (_VISION_LAYER + r"ls2", r"model.vision_tower.encoder.layer.\1.lambda_2"),
    (_VISION_LAYER + r"norm1\.(weight|bias)", r"model.vision_tower.encoder.layer.\1.layernorm_before.\2"),
    (_VISION_LAYER + r"norm2\.(weight|bias)", r"model.vision_tower.encoder.layer.\1.layernorm_after.\2"),
    (_VISION_LAYER + r"mlp\.(fc1|fc2)\.(weight|bias)", r"model.vision_tower.encoder.layer.\1.mlp.\2.\3"),
    (r"mlp1\.0\.(weight|bias)", r"model.multi_modal_projector.layer_norm.\1"),
    (r"mlp1\.1\.(weight|bias)", r"model.multi_modal_projector.linear_1.\1"),
    (r"mlp1\.3\.(weight|bias)", r"model.multi_modal_projector.linear_2.\1"),
)]
_VISION_QKV = re.compile(_VISION_LAYER + r"attn\.qkv\.(weight|bias)")


class UnsupportedInternVLError(HubError):
    """An `internvl_chat` checkpoint whose language model (or vision settings) the conversion does not cover."""


def is_internvl_chat(path: str | Path) -> bool:
    """True when `path` is a model directory whose config.json is OpenGVLab's remote-code InternVL."""
    config = Path(path) / "config.json"
    if not config.is_file():
        return False
    values = internlm2._read_json(config)
    return values.get("model_type") == "internvl_chat" or "InternVLChatModel" in (values.get("architectures") or [])


def materialise_internvl(src: Path, content_hash: str) -> Path:
    """The native `internvl` directory converted from InternVL checkpoint `src`; written on first use only."""
    final = cache_dir("models") / f"internvl-native-v{_LAYOUT_VERSION}-{content_hash[:16]}"
    return converted_once(src, final, INTERNVL, "the native `internvl` layout", convert_internvl_to_native)


def convert_internvl_to_native(src: str | Path, dst: str | Path) -> None:
    """Write a native `internvl` checkpoint (config, safetensors, tokenizer, preprocessor_config.json)."""
    src, dst = Path(src), Path(dst)
    source = internlm2._read_json(src / "config.json")
    llm_kind = _llm_kind(source, src)
    dst.mkdir(parents=True, exist_ok=True)
    # The tokenizer first: the native config needs the id of <IMG_CONTEXT>.
    _convert_tokenizer(src, dst)
    config = _native_config(source, llm_kind, _image_token_id(dst, src), src)
    _convert_weights(src, dst, config, llm_kind)
    config.save_pretrained(dst)
    _write_preprocessor_config(source, config, dst)
    write_processor_settings(dst, config.image_seq_length)
    if (src / "generation_config.json").is_file():
        shutil.copyfile(src / "generation_config.json", dst / "generation_config.json")


# --- config -------------------------------------------------------------------------------------------------


def _llm_kind(source: dict, src: Path) -> str:
    missing = [key for key in ("llm_config", "vision_config") if not isinstance(source.get(key), dict)]
    if missing:
        raise HubError(f"InternVL checkpoint {str(src)!r}: config.json lacks {missing}; download it again")
    llm = source["llm_config"]
    architecture = (llm.get("architectures") or [None])[0]
    if architecture in SUPPORTED_LLMS:
        return architecture
    raise UnsupportedInternVLError(
        f"InternVL checkpoint {str(src)!r}: its language model is {architecture or llm.get('model_type')!r} "
        f"(llm_config.architectures), which the conversion to transformers' native `internvl` does not support; "
        f"supported language models: {list(SUPPORTED_LLMS)}. Use the checkpoint's `-hf` form if one exists"
    )


def _text_config(llm: dict, kind: str, src: Path) -> dict:
    if kind in _INTERNLM2:
        text = internlm2._llama_config(llm, src).to_dict()
        text.pop("twinkle_source_family", None)  # the native config itself names the family
        text.pop("architectures", None)
        return text
    text = {key: value for key, value in llm.items() if key not in _LLM_CODE_KEYS}
    text["model_type"] = "qwen2" if kind == "Qwen2ForCausalLM" else "llama"
    return text


def _native_config(source: dict, kind: str, image_token_id: int, src: Path):
    from transformers import InternVLConfig

    vision = source["vision_config"]
    absent = [key for key in _VISION_REQUIRED if key not in vision]
    if absent:
        raise HubError(f"InternVL checkpoint {str(src)!r}: vision_config in config.json lacks {absent}; "
                       "download it again")
    if source.get("ps_version", "v2") != "v2":
        raise UnsupportedInternVLError(
            f"InternVL checkpoint {str(src)!r}: ps_version={source.get('ps_version')!r}; the native `internvl` "
            "model implements the 'v2' pixel shuffle only (InternVL 1.5 and later)"
        )
    if source.get("use_thumbnail") is False and source.get("dynamic_image_size", True):
        raise UnsupportedInternVLError(
            f"InternVL checkpoint {str(src)!r}: use_thumbnail=false; the native image processor always adds a "
            "thumbnail to tiled images"
        )
    norm = vision.get("norm_type", "rms_norm")
    if norm not in ("layer_norm", "rms_norm"):
        raise UnsupportedInternVLError(f"InternVL checkpoint {str(src)!r}: vision norm_type={norm!r} is unknown")
    side = source.get("force_image_size") or vision.get("image_size", 448)
    patch = vision.get("patch_size", 14)
    ratio = source.get("downsample_ratio", 0.5)
    text = _text_config(source["llm_config"], kind, src)
    tied = bool(text.get("tie_word_embeddings", False))
    extra = {"dtype": source["torch_dtype"]} if "torch_dtype" in source else {}
    return InternVLConfig(
        architectures=["InternVLForConditionalGeneration"],
        text_config=text,
        vision_config=dict(
            hidden_size=vision["hidden_size"], intermediate_size=vision["intermediate_size"],
            num_hidden_layers=vision["num_hidden_layers"], num_attention_heads=vision["num_attention_heads"],
            num_channels=vision.get("num_channels", 3), image_size=[side, side], patch_size=[patch, patch],
            attention_bias=bool(vision.get("qkv_bias", False)),
            use_qk_norm=bool(vision.get("qk_normalization", False)),
            norm_type=norm, hidden_act=vision.get("hidden_act", "gelu"),
            layer_norm_eps=vision.get("layer_norm_eps", 1e-6),
            attention_dropout=vision.get("attention_dropout", 0.0), hidden_dropout_prob=vision.get("dropout", 0.0),
            initializer_range=vision.get("initializer_range", 0.02), use_mean_pooling=True,
        ),
        image_token_id=image_token_id,
        image_seq_length=int((side // patch) ** 2 * ratio ** 2),
        downsample_ratio=ratio,
        projector_hidden_act="gelu",
        vision_feature_layer=source.get("select_layer", -1),
        vision_feature_select_strategy="default",
        tie_word_embeddings=tied,
        **extra,
    )


_BPE_FILES = ("vocab.json", "merges.txt")
_TOKENIZER_SIDE_FILES = ("added_tokens.json", "special_tokens_map.json", "chat_template.jinja")


def _convert_tokenizer(src: Path, dst: Path) -> None:
    """A plain tokenizer without the checkpoint's code: tokenizer.json or tokenizer.model as for InternLM2, or
    vocab.json + merges.txt of a built-in class (Qwen2Tokenizer: InternVL2_5-1B/4B, InternVL3), loaded from a
    staging folder that holds no config.json and no auto_map."""
    import tempfile

    from transformers import AutoTokenizer

    if (src / "tokenizer.json").is_file() or (src / "tokenizer.model").is_file():
        internlm2._convert_tokenizer(src, dst)
        return
    settings = internlm2._read_json(src / "tokenizer_config.json") if (src / "tokenizer_config.json").is_file() else {}
    if not all((src / name).is_file() for name in _BPE_FILES) or settings.get("auto_map"):
        raise HubError(
            f"InternVL checkpoint {str(src)!r}: no tokenizer.json, tokenizer.model, or vocab.json + merges.txt of a "
            "built-in tokenizer class; download the tokenizer files"
        )
    if not settings.get("tokenizer_class"):
        raise HubError(
            f"InternVL checkpoint {str(src)!r}: tokenizer_config.json names no tokenizer_class for vocab.json + "
            "merges.txt; download it again"
        )
    with tempfile.TemporaryDirectory(prefix="internvl-tokenizer-") as staging:
        staged = Path(staging)
        for name in (*_BPE_FILES, *_TOKENIZER_SIDE_FILES, "tokenizer_config.json"):
            if (src / name).is_file():
                shutil.copyfile(src / name, staged / name)
        try:
            tokenizer = AutoTokenizer.from_pretrained(staged, trust_remote_code=False)
        except (ValueError, OSError) as exc:
            raise HubError(f"InternVL checkpoint {str(src)!r}: its tokenizer could not be loaded ({exc})") from exc
    tokenizer.save_pretrained(dst)


def _image_token_id(dst: Path, src: Path) -> int:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(dst)
    for token in (NAMED_TOKENS["start_image_token"], NAMED_TOKENS["end_image_token"], IMAGE_CONTEXT_TOKEN):
        token_id = tokenizer.convert_tokens_to_ids(token)
        if token_id is None or token_id == tokenizer.unk_token_id:
            raise HubError(
                f"InternVL checkpoint {str(src)!r}: its tokenizer has no {token} token, which marks the image "
                "features; download the tokenizer files again"
            )
    return tokenizer.convert_tokens_to_ids(IMAGE_CONTEXT_TOKEN)


def write_processor_settings(model_dir: Path, image_seq_length: int) -> None:
    """What transformers' InternVLProcessor needs beyond preprocessor_config.json: the tokenizer's named media
    tokens, and processor_config.json with the context tokens per tile (its default, 256, is InternVL's 448-pixel
    tiles only)."""
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(model_dir, extra_special_tokens=NAMED_TOKENS).save_pretrained(model_dir)
    settings = {"processor_class": "InternVLProcessor", "image_seq_length": int(image_seq_length)}
    (Path(model_dir) / "processor_config.json").write_text(json.dumps(settings, indent=2) + "\n")


def _write_preprocessor_config(source: dict, config, dst: Path) -> None:
    side = config.vision_config.image_size[0]
    settings = {
        "image_processor_type": "GotOcr2ImageProcessor", "size": {"height": side, "width": side},
        "crop_to_patches": bool(source.get("dynamic_image_size", True)),
        "min_patches": source.get("min_dynamic_patch", 1), "max_patches": source.get("max_dynamic_patch", 12),
        "image_mean": _IMAGENET_MEAN, "image_std": _IMAGENET_STD, "do_rescale": True, "rescale_factor": 1 / 255,
        "do_normalize": True, "do_convert_rgb": True, "do_resize": True,
    }
    (dst / "preprocessor_config.json").write_text(json.dumps(settings, indent=2) + "\n")


# --- weights ------------------------------------------------------------------------------------------------


INTERNVL = Conversion("InternVL checkpoint", "a native InternVL model",
                      "check the layer counts, biases and qk_normalization in config.json",
                      "native `internvl` names; the download is incomplete or config.json does not match the weights")


def _convert_weights(src: Path, dst: Path, config, kind: str) -> None:
    """Rename and split tensors shard by shard, so peak memory stays near one source shard."""
    from transformers import InternVLForConditionalGeneration

    text = config.text_config
    heads = internlm2._Heads(text.num_attention_heads, text.num_key_value_heads,
                             getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads)
    write_converted(src, dst, InternVLForConditionalGeneration, config,
                    lambda name, tensor: _converted(name, tensor, kind, heads, src), INTERNVL)


def _converted(name: str, tensor, kind: str, heads, src: Path) -> list[tuple[str, object]]:
    """The native (name, tensor) pairs for one InternVL tensor."""
    if name.startswith("language_model."):
        return _converted_llm(name.removeprefix("language_model."), tensor, kind, heads, src)
    match = _VISION_QKV.fullmatch(name)
    if match:
        layer, kind_ = match.groups()
        if tensor.shape[0] % 3:
            raise HubError(f"InternVL checkpoint {str(src)!r}: {name} has {tensor.shape[0]} rows, not 3 equal parts")
        # InternViT reshapes qkv's output as (3, heads, head_dim): the rows are [q..., k..., v...].
        parts = tensor.chunk(3, dim=0)
        return [(f"model.vision_tower.encoder.layer.{layer}.attention.{proj}_proj.{kind_}", part.clone())
                for proj, part in zip("qkv", parts)]
    for pattern, replacement in _VISION_RENAMES:
        if pattern.fullmatch(name):
            return [(pattern.sub(replacement, name), tensor)]
    raise HubError(f"InternVL checkpoint {str(src)!r}: tensor {name!r} is not part of the InternVL layout")


def _converted_llm(name: str, tensor, kind: str, heads, src: Path) -> list[tuple[str, object]]:
    if kind in _INTERNLM2:
        try:
            pairs = internlm2._converted(name, tensor, heads, src)
        except HubError as exc:
            raise HubError(f"InternVL checkpoint {str(src)!r}: language model: {exc}") from None
    elif internlm2._ROTARY_BUFFER.fullmatch(name):
        pairs = []
    else:
        pairs = [(name, tensor)]
    out = []
    for new_name, part in pairs:
        if new_name.startswith("model."):
            new_name = "model.language_model." + new_name.removeprefix("model.")
        out.append((new_name, part))
    return out


