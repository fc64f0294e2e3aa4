"""Row kinds: how a row of each kind is validated and encoded, in a registry new kinds can join.

Embedding (query/positive/negatives), VLM (images) and preference (chosen/rejected) rows register
here with their own validator, encoder, truncation, token count and batch collation; load_rows,
tokenize_dataset, the recipe and the model only look kinds up.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from twinkle_core.config.registry import Registry

from . import pairs, preference, prompts
from .vision_collate import BATCH_KEYS as VISION_BATCH_KEYS
from .vision_collate import collate_vision, pack_vision_examples, truncate_vision
from .vision_encode import encode_vision_prompt, encode_vision_row, load_vision_processor
from .vision_rows import ROW_KEYS as VISION_ROW_KEYS
from .vision_rows import validate_vision_row
from .collate import collate, collate_padding_free
from .encode import count_trained_tokens, encode_chat, encode_chats, encode_text, encode_texts, truncate
from .packing import pack_examples
from .validate import CHAT_ROW_KEYS, TEXT_ROW_KEYS, validate_text_chat_row, validate_text_row


def _token_counts(example: dict) -> tuple[int, int]:
    return len(example["input_ids"]), count_trained_tokens(example["labels"])


def _longer_than(example: dict, max_length: int) -> bool:
    return len(example["input_ids"]) > max_length


@dataclass(frozen=True)
class RowFormat:
    """A row kind: `validate(row)` returns the normalised row or raises RowError;
    `encode(tokenizer, row, enable_thinking=..., **options)` returns an example (a dict of token lists: for
    chat and text at least input_ids and labels), or a list of examples, untruncated; kinds without replies
    to think about ignore enable_thinking."""

    kind: str
    validate: Callable[[Any], dict]
    encode: Callable[..., dict | list[dict]]
    # (encoder, rows, enable_thinking=..., **options) -> encode() of each row, in one batched tokenizer call; a row
    # that cannot be encoded gives its RowError (or ChatTemplateError) in its place. None: row by row.
    encode_batch: Callable[..., list] | None = None
    needs_chat_template: bool = True  # its rows are rendered with the tokenizer's chat template
    truncate: Callable[[dict, int], dict] = truncate
    was_truncated: Callable[[dict, int], bool] = _longer_than
    count_tokens: Callable[[dict], tuple[int, int]] = _token_counts  # (tokens, trained tokens)
    num_sequences: Callable[[dict], int] = lambda example: 1  # texts the model reads per example
    collate: Callable[..., dict] = collate  # (examples, pad_token_id=, mask_dtype=) -> a batch of tensors
    batch_keys: tuple[str, ...] = ("input_ids", "labels")  # what a collated batch must hold
    # (examples) -> one row of the samples end to end, for models that train padding-free; None: always padded
    collate_padding_free: Callable[[list[dict]], dict] | None = collate_padding_free
    packable: bool = True
    pack: Callable[[list[dict], int], list[dict]] = pack_examples  # (examples, max_length) -> packed sequences
    # Rows that name files (images, videos): validate(row, folder=...) finds relative paths in the data file's folder.
    reads_files: bool = False
    # (tokenizer, model_dir) -> what encode() takes in the tokenizer's place (a VLM's processor); None: the tokenizer
    encoder: Callable[[Any, Path], Any] | None = None
    # (encoder, messages, **encode options) -> an example of a prompt for generation; None: chat text only
    prompt: Callable[..., dict] | None = None
    # The top-level row keys the kind reads, in any layout it accepts: tokenize_dataset warns of the others, which
    # training ignores. None: no key is ignored (prompt rows hand theirs to the reward functions).
    fields: frozenset[str] | None = None

    def check(self, row: Any, folder: Path | None = None) -> dict:
        """The validated row; `folder` is where the row's data file lies (None: the working directory)."""
        return self.validate(row, folder=folder) if self.reads_files else self.validate(row)

    def load_encoder(self, tokenizer, model_dir: Path):
        """What encode() takes: the tokenizer, or the kind's encoder built from the model directory."""
        return self.encoder(tokenizer, Path(model_dir)) if self.encoder else tokenizer


_FORMATS: Registry[RowFormat] = Registry("kind", "row kind")


def register_row_format(row_format: RowFormat) -> RowFormat:
    """Add a row kind; a kind can be registered only once."""
    return _FORMATS.register(row_format.kind, row_format)


def get_row_format(kind: str) -> RowFormat:
    """The registered format of `kind`."""
    return _FORMATS.get(kind)


def row_kinds() -> list[str]:
    """The registered row kinds, sorted."""
    return _FORMATS.names()


def _encode_chat_row(tokenizer, row: dict, enable_thinking: bool = True) -> dict:
    return encode_chat(tokenizer, row["messages"], tools=row.get("tools"), enable_thinking=enable_thinking)


def _encode_chat_rows(tokenizer, rows: list[dict], enable_thinking: bool = True) -> list:
    return encode_chats(tokenizer, [(row["messages"], row.get("tools")) for row in rows], enable_thinking)


def _encode_text_row(tokenizer, row: dict, enable_thinking: bool = True) -> dict:
    return encode_text(tokenizer, row["text"])


def _encode_text_rows(tokenizer, rows: list[dict], enable_thinking: bool = True) -> list[dict]:
    return encode_texts(tokenizer, [row["text"] for row in rows])


register_row_format(RowFormat("chat", validate_text_chat_row, _encode_chat_row, encode_batch=_encode_chat_rows,
                              fields=CHAT_ROW_KEYS))
register_row_format(RowFormat("text", validate_text_row, _encode_text_row, encode_batch=_encode_text_rows,
                              needs_chat_template=False, fields=TEXT_ROW_KEYS))
register_row_format(RowFormat(
    "pairs", pairs.validate_pair_row, pairs.encode_pair_row, needs_chat_template=False, truncate=pairs.truncate_pair,
    was_truncated=pairs.was_truncated, count_tokens=pairs.count_pair_tokens, num_sequences=pairs.num_texts,
    collate=pairs.collate_pairs, collate_padding_free=None, batch_keys=pairs.BATCH_KEYS, packable=False,
    fields=pairs.ROW_KEYS))
register_row_format(RowFormat(
    "preference", preference.validate_preference_row, preference.encode_preference_row,
    truncate=preference.truncate_preference, was_truncated=preference.was_truncated,
    count_tokens=preference.count_preference_tokens, num_sequences=lambda example: 2,
    collate=preference.collate_preferences,
    collate_padding_free=preference.collate_preferences_padding_free, batch_keys=preference.BATCH_KEYS,
    packable=False, fields=preference.ROW_KEYS))
register_row_format(RowFormat(
    "prompts", prompts.validate_prompt_row, prompts.encode_prompt_row, truncate=prompts.truncate_prompt,
    was_truncated=prompts.prompt_too_long, count_tokens=prompts.count_prompt_tokens, collate=prompts.no_collate,
    # Not collated (the GRPO recipe batches sampled completions), but trained padding-free where the model can.
    collate_padding_free=prompts.no_collate, batch_keys=prompts.BATCH_KEYS, packable=False))
register_row_format(RowFormat(
    "vision_chat", validate_vision_row, encode_vision_row, truncate=truncate_vision, collate=collate_vision,
    collate_padding_free=None, batch_keys=VISION_BATCH_KEYS, reads_files=True, encoder=load_vision_processor,
    prompt=encode_vision_prompt, pack=pack_vision_examples, fields=VISION_ROW_KEYS))
