"""The registry of supported model families: one declarative entry each, no if-chains elsewhere."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from twinkle_core.errors import UserError


# Written into the config.json of checkpoints converted to another layout, naming the family they came from.
SOURCE_FAMILY_KEY = "twinkle_source_family"


class UnsupportedModelError(UserError):
    """A model id or model_type that no registered family covers; the message lists the families."""


@dataclass(frozen=True)
class VisionParts:
    """Where a vision-language model keeps its parts, as module-name prefixes (the longest match owns a
    module): what freeze_vision / freeze_aligner / freeze_llm freeze and keep LoRA off."""

    vision_tower: tuple[str, ...]
    aligner: tuple[str, ...]
    language_model: tuple[str, ...]

    def part_of(self, name: str) -> str | None:
        """'vision_tower', 'aligner' or 'language_model' for a module or parameter name; None: none of them."""
        best, owner = -1, None
        for part in ("vision_tower", "aligner", "language_model"):
            for prefix in getattr(self, part):
                if (name == prefix or name.startswith(prefix + ".")) and len(prefix) > best:
                    best, owner = len(prefix), part
        return owner


@dataclass(frozen=True)
class ModelFamily:
    name: str  # registry key, e.g. "qwen2_5"
    title: str  # as people say it, e.g. "Qwen 2.5"
    model_types: tuple[str, ...]  # Hugging Face config.json model_type values
    model_ids: str  # the checkpoints the specification names (for docs)
    id_pattern: str  # regex on "org/name" of hub ids (case-insensitive) for early validation
    chat_template: str | None  # name in twinkle_core.data chat templates, used when a tokenizer has none
    end_of_turn: tuple[str, ...]  # special tokens that end an assistant turn
    moe_model_types: tuple[str, ...] = ()  # the model_types that are mixture-of-experts
    thinking: bool = False  # has a thinking / reasoning mode
    tools: bool = True  # its template renders tool calls and tool results
    megatron: bool = False  # megatron-core GPTModel can express it (the HF <-> Megatron bridge)
    lora_target_modules: str | tuple[str, ...] = "all-linear"
    lora_exclude_modules: tuple[str, ...] = ()  # linears LoRA must not wrap (e.g. grouped projections)
    default_for_model_type: bool = True  # the family a bare model_type maps to when several share it
    tested: bool = True  # False: a model_type outside the registry, trained with what its model declares
    # Embedding families (the embedding flow): how hidden states become one vector, and the query instruction.
    pooling: str | None = None  # "last", "cls" or "mean"; a checkpoint's own 1_Pooling/config.json wins
    query_prompt: str = ""  # put before every query; "{task}" is replaced by the task text
    query_task: str = ""  # the published default task text
    vision: VisionParts | None = None  # vision-language families: loaded with AutoModelForImageTextToText
    notes: str = ""
    _id_regex: re.Pattern = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        if not self.model_types:
            raise ValueError(f"family {self.name!r}: model_types must not be empty")
        unknown = set(self.moe_model_types) - set(self.model_types)
        if unknown:
            raise ValueError(f"family {self.name!r}: moe_model_types {sorted(unknown)} are not in model_types")
        object.__setattr__(self, "_id_regex", re.compile(self.id_pattern, re.IGNORECASE))

    @property
    def is_embedding(self) -> bool:
        return self.pooling is not None

    @property
    def is_vision(self) -> bool:
        return self.vision is not None

    @property
    def has_moe(self) -> bool:
        return bool(self.moe_model_types)

    def is_moe(self, model_type: str) -> bool:
        return model_type in self.moe_model_types

    def matches_id(self, repo: str) -> bool:
        return bool(self._id_regex.search(repo))


_FAMILIES: dict[str, ModelFamily] = {}


def register_family(family: ModelFamily) -> ModelFamily:
    """Add a family; a duplicate name, or a second default for the same model_type, is rejected."""
    if family.name in _FAMILIES:
        raise ValueError(f"family {family.name!r} is already registered")
    if family.default_for_model_type:
        for other in _FAMILIES.values():
            shared = set(other.model_types) & set(family.model_types)
            if other.default_for_model_type and shared:
                raise ValueError(f"families {other.name!r} and {family.name!r} both claim model_type(s) "
                                 f"{sorted(shared)} by default; set default_for_model_type=False on one")
    _FAMILIES[family.name] = family
    return family


def families() -> list[ModelFamily]:
    return list(_FAMILIES.values())


# An untested family's name: the prefix and its model_type ("untested-gemma2").
UNTESTED_PREFIX = "untested-"


def untested_family(model_type: str) -> ModelFamily:
    """A model_type no registered family covers: everything it can do comes from the model itself.

    Its tokenizer's own chat template is used (or the one the user names), LoRA targets every linear
    layer, and the tensor-parallel plan, experts, router loss and attention kind are read from its config.
    """
    return ModelFamily(
        name=UNTESTED_PREFIX + model_type, title=f"untested ({model_type})", model_types=(model_type,),
        model_ids="", id_pattern=r"(?!)", chat_template=None, end_of_turn=(), tested=False,
        notes=f"model_type {model_type!r} is not in the tested list; it trains on the Transformers backend with what "
              "the model declares: its own chat template, all-linear LoRA targets, its tp plan and experts",
    )


def get_family(name: str) -> ModelFamily:
    if name.startswith(UNTESTED_PREFIX):
        return untested_family(name.removeprefix(UNTESTED_PREFIX))
    if name not in _FAMILIES:
        raise UnsupportedModelError(f"family {name!r} is not registered; choose one of {sorted(_FAMILIES)}.")
    return _FAMILIES[name]


def _supported() -> str:
    return "; ".join(f"{f.title} ({', '.join(f.model_types)})" for f in _FAMILIES.values())


def family_for_model_type(model_type: str, model_id: str | None = None, embedding: bool = False,
                          vision: bool = False) -> ModelFamily:
    """The family of a config.json model_type; the id picks among families sharing a model_type, and so do
    `embedding` (a sentence-transformers directory: Qwen3-Embedding rather than Qwen 3) and `vision` (a
    vision-language objective: a `qwen3_5` checkpoint with its vision tower is Qwen 3.5 VL, not the text-only
    Qwen 3.5 that AutoModelForCausalLM loads from the same checkpoint).

    A model_type no family covers gets an untested family (see `untested_family`).
    """
    candidates = [f for f in _FAMILIES.values() if model_type in f.model_types]
    if not candidates:
        return untested_family(model_type)
    repo = _repo_of(model_id) if model_id else None
    by_id = [f for f in candidates if repo and f.matches_id(repo)]
    if by_id:
        return by_id[0]
    same_kind = [f for f in candidates if f.is_embedding == embedding] or candidates
    same_kind = [f for f in same_kind if f.is_vision == vision] or same_kind
    return ([f for f in same_kind if f.default_for_model_type] or same_kind)[0]


def _repo_of(model_id: str) -> str:
    """'ms://Qwen/Qwen3.5-4B@main' -> 'Qwen/Qwen3.5-4B'; local paths give their last two parts."""
    text = model_id.split("://", 1)[-1].split("@", 1)[0].rstrip("/")
    return "/".join(text.split("/")[-2:])


def family_for_model_id(model_id: str) -> ModelFamily | None:
    """The family a hub id (ms://, hf://) names, before anything is downloaded; None if it names none."""
    if not model_id.startswith(("ms://", "hf://")):
        return None
    repo = _repo_of(model_id)
    matches = [f for f in _FAMILIES.values() if f.matches_id(repo)]
    return matches[0] if matches else None


def family_for_model_dir(path: str | Path, model_id: str | None = None,
                         trust_remote_code: bool = False, vision: bool = False) -> ModelFamily:
    """The family of a downloaded Hugging Face directory (from its config.json model_type); `vision`: a
    vision-language run, which picks a model_type's vision family when its config has a `vision_config`.

    A checkpoint whose architecture exists only as code shipped beside its weights is refused unless
    `trust_remote_code`: running that code runs whatever it contains, with the caller's rights.
    """
    config = Path(path) / "config.json"
    if not config.exists():
        raise UnsupportedModelError(f"{path} has no config.json, so its model family cannot be told.")
    values = json.loads(config.read_text())
    remote = remote_code_of(values)
    if remote and not trust_remote_code:
        raise UnsupportedModelError(
            f"{model_id or path}: model_type {values.get('model_type')!r} is not built into transformers; the "
            f"checkpoint ships its own modelling code ({remote}), and twinkle never runs a checkpoint's code "
            "unless asked. Pass --trust-remote-code (trust_remote_code=True) to run it: it executes that "
            "code on this machine with your rights, so read it first.")
    if values.get(SOURCE_FAMILY_KEY):  # a checkpoint we converted (e.g. InternLM2 -> Llama layout)
        return get_family(values[SOURCE_FAMILY_KEY])
    model_type = values.get("model_type")
    if not model_type:
        raise UnsupportedModelError(f"{config} has no model_type; supported families: {_supported()}.")
    return family_for_model_type(model_type, model_id, embedding=(Path(path) / "modules.json").is_file(),
                                 vision=vision and bool(values.get("vision_config")))


def remote_code_of(config: dict) -> str | None:
    """The code files a config.json needs for its architecture (None: transformers has it built in)."""
    from transformers import CONFIG_MAPPING

    auto_map = config.get("auto_map") or {}
    if not auto_map or config.get("model_type") in CONFIG_MAPPING:
        return None
    return ", ".join(f"{name}: {target}" for name, target in sorted(auto_map.items()))


def family_before_download(model_id: str) -> ModelFamily | None:
    """The family a model id names before anything is downloaded: a hub id by its name, a local directory by
    its config.json; None when it cannot be told (a GGUF file, a remote-code model, an id of no family)."""
    if model_id.startswith(("ms://", "hf://")):
        return family_for_model_id(model_id)
    path = Path(model_id.removeprefix("file://")).expanduser()
    if not (path / "config.json").is_file():
        return None
    try:
        return family_for_model_dir(path, model_id)
    except (UnsupportedModelError, ValueError):
        return None


# Ids of model kinds the specification lists for later releases: fail early with a clear message.
_NOT_YET = (
    (re.compile(r"-vl-|-vl$|internvl", re.IGNORECASE), "vision-language models"),
)


def check_model_id(model_id: str) -> ModelFamily | None:
    """Validate a model id before download: the family it names, None when it cannot be told yet."""
    family = family_for_model_id(model_id)
    if family is not None or not model_id.startswith(("ms://", "hf://")):
        return family
    repo = _repo_of(model_id)
    for pattern, kind in _NOT_YET:
        if pattern.search(repo):
            raise UnsupportedModelError(
                f"model_id={model_id!r}: {kind} are not supported by the sft flow yet; "
                f"supported language-model families: {_supported()}."
            )
    return None
