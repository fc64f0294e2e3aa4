"""How a checkpoint turns text into an embedding: its pooling and its query instruction.

The checkpoint's own sentence-transformers files decide first (modules.json → the pooling folder's
config.json, config_sentence_transformers.json's "query" prompt), then the family's defaults, then the
run's explicit choices override both. Tokenising, training, exporting and evaluating all read these, so
the registered model embeds exactly as it was trained.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

POOLINGS = ("mean", "cls", "last")
# sentence-transformers' Pooling config keys → our pooling names
_POOLING_KEYS = {"pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls", "pooling_mode_lasttoken": "last"}


@dataclass(frozen=True)
class EmbeddingSettings:
    pooling: str  # mean, cls or last
    query_prompt: str = ""  # text put before every query (documents get none)

    @property
    def append_eos(self) -> bool:
        """Last-token models read the state at EOS: every text ends with it."""
        return self.pooling == "last"

    def encode_options(self) -> dict:
        """What the pairs row kind's encoder takes (and the tokenised cache key holds)."""
        return {"query_prompt": self.query_prompt, "append_eos": self.append_eos}

    def as_dict(self) -> dict:
        return asdict(self)


def _read_json(path: Path) -> dict | list | None:
    return json.loads(path.read_text()) if path.is_file() else None


def checkpoint_pooling(model_dir: str | Path) -> str | None:
    """The pooling a sentence-transformers directory declares, or None (no file, or a mode we do not have)."""
    model_dir = Path(model_dir)
    modules = _read_json(model_dir / "modules.json") or []
    folders = [m.get("path", "") for m in modules if str(m.get("type", "")).endswith("Pooling")]
    config = _read_json(model_dir / (folders[0] if folders else "1_Pooling") / "config.json")
    if not config:
        return None
    chosen = [name for key, name in _POOLING_KEYS.items() if config.get(key)]
    others = [key for key, value in config.items() if key.startswith("pooling_mode") and value
              and key not in _POOLING_KEYS]
    if others or len(chosen) != 1:
        raise ValueError(f"{model_dir}: its pooling config asks for {sorted(others) or chosen}; twinkle trains "
                         f"one of {', '.join(POOLINGS)} (pass pooling= to choose)")
    return chosen[0]


def checkpoint_query_prompt(model_dir: str | Path) -> str | None:
    config = _read_json(Path(model_dir) / "config_sentence_transformers.json") or {}
    return (config.get("prompts") or {}).get("query")


def resolve_settings(model_dir: str | Path, family, pooling: str | None = None,
                     query_task: str | None = None) -> EmbeddingSettings:
    """The run's embedding settings: explicit choices, else the checkpoint's files, else the family's."""
    chosen = pooling or checkpoint_pooling(model_dir) or family.pooling
    if chosen is None:
        raise ValueError(f"{model_dir}: the {family.title} family has no embedding pooling and the checkpoint "
                         f"declares none; pass pooling= (one of {', '.join(POOLINGS)})")
    if chosen not in POOLINGS:
        raise ValueError(f"pooling={chosen!r}: choose one of {', '.join(POOLINGS)}")
    if query_task is not None:
        if not family.query_prompt:
            raise ValueError(f"query_task is set, but the {family.title} family takes no query instruction")
        prompt = family.query_prompt.format(task=query_task)
    else:
        prompt = checkpoint_query_prompt(model_dir)
        if prompt is None:
            prompt = family.query_prompt.format(task=family.query_task) if family.query_prompt else ""
    return EmbeddingSettings(chosen, prompt)
