"""Turn validated rows into token ids and labels (-100 where no loss is taken)."""
from __future__ import annotations

import itertools

import numpy as np
import torch

from .errors import ChatTemplateError, RowError
from .spans import assistant_spans
from .templates import render_chat

IGNORE_INDEX = -100
_IDS_ONLY = {"return_attention_mask": False, "return_token_type_ids": False}  # lists nobody reads, per token


def _check_fast(tokenizer) -> None:
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError(
            f"tokenizer {tokenizer.name_or_path!r} is a slow (Python) tokenizer; label masking needs character "
            "offsets, which only fast tokenizers give: load it with use_fast=True or ship a tokenizer.json"
        )


def truncate(example: dict, max_length: int | None) -> dict:
    """Keep the first `max_length` tokens of every per-token list in `example`."""
    if max_length is None or len(example["input_ids"]) <= max_length:
        return example
    return {key: value[:max_length] for key, value in example.items()}


def encode_chat(
    tokenizer, messages: list[dict], max_length: int | None = None, tools: list[dict] | None = None,
    enable_thinking: bool = True,
) -> dict:
    """Token ids of the rendered conversation; labels only on assistant replies and their end-of-turn token.

    `tools` (JSON schemas) go to the chat template; enable_thinking=False trains replies without their reasoning,
    in the template's non-thinking form.
    """
    example = encode_chats(tokenizer, [(messages, tools)], enable_thinking)[0]
    if isinstance(example, Exception):
        raise example
    return truncate(example, max_length)


def encode_chats(
    tokenizer, chats: list[tuple[list[dict], list[dict] | None]], enable_thinking: bool = True,
) -> list[dict | ChatTemplateError | RowError]:
    """encode_chat (untruncated) of each (messages, tools), tokenised in one batched call: a tokenizer call
    costs more per text alone than in a batch. A conversation the template cannot render gives its error in
    its place, so it costs only its own row."""
    rendered: list = []
    for messages, tools in chats:
        try:
            rendered.append(assistant_spans(tokenizer, messages, tools=tools, enable_thinking=enable_thinking))
        except (ChatTemplateError, RowError) as error:
            rendered.append(error)
    texts = [text for text, _ in (item for item in rendered if not isinstance(item, Exception))]
    if not texts:
        return rendered
    _check_fast(tokenizer)
    backend = tokenizer.backend_tokenizer
    if backend.truncation is not None or backend.padding is not None:  # settings only the wrapper call resets
        tokenizer(texts[:1], add_special_tokens=False, **_IDS_ONLY)
    # The template already writes BOS and friends; add_special_tokens=True would add BOS a second time. The
    # backend's own batch call: the wrapper would turn every token's offsets into Python, where the labels need
    # only the tokens at each reply's two ends.
    encodings = iter(backend.encode_batch(texts, add_special_tokens=False))
    return [item if isinstance(item, Exception) else _labelled(next(encodings), item[1]) for item in rendered]


def _labelled(encoding, spans: list[tuple[int, int]]) -> dict:
    input_ids = encoding.ids
    labels = [IGNORE_INDEX] * len(input_ids)
    for start, end in spans:
        first, last = _span_tokens(encoding, start, end, len(input_ids))
        if first is None:  # a reply end falls on no token (normalised away): every token's offsets decide
            return {"input_ids": input_ids, "labels": _reply_labels(input_ids, encoding.offsets, spans)}
        labels[first:last + 1] = input_ids[first:last + 1]
    return {"input_ids": input_ids, "labels": labels}


def _span_tokens(encoding, start: int, end: int, count: int) -> tuple[int | None, int | None]:
    """The first and last token overlapping characters [start, end) (a token straddling either end is in): the
    tokens holding the span's first and last character, widened over neighbours whose offsets still overlap
    (several byte-level tokens share one character; a token without characters stops the widening)."""
    if end <= start:
        return None, None
    first, last = encoding.char_to_token(start), encoding.char_to_token(end - 1)
    if first is None or last is None or first > last:
        return None, None
    while first > 0 and (encoding.token_to_chars(first - 1) or (0, 0))[1] > start:
        first -= 1
    while last + 1 < count and (encoding.token_to_chars(last + 1) or (end, end))[0] < end:
        last += 1
    return first, last


def _reply_labels(input_ids: list[int], offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[int]:
    """input_ids where a token overlaps a reply span (a token straddling header and reply is trained), else
    IGNORE_INDEX. Spans are in text order and do not overlap, so a token can only overlap the first span that
    ends after the token starts: one binary search per token, in numpy."""
    if not spans or not input_ids:
        return [IGNORE_INDEX] * len(input_ids)
    ids = np.asarray(input_ids, dtype=np.int64)
    pairs = np.fromiter(itertools.chain.from_iterable(offsets), dtype=np.int64, count=2 * len(offsets))
    starts, ends = pairs[0::2], pairs[1::2]
    span_starts, span_ends = (np.asarray(column, dtype=np.int64) for column in zip(*spans))
    first = np.searchsorted(span_ends, starts, side="right")  # the first span ending after the token starts
    found = first < len(spans)
    first = np.minimum(first, len(spans) - 1)
    overlaps = found & (ends > span_starts[first]) & (starts < span_ends[first])
    return np.where(overlaps, ids, IGNORE_INDEX).tolist()


def encode_text(tokenizer, text: str, max_length: int | None = None) -> dict:
    """Pre-training tokens: the tokenizer's own BOS convention, EOS appended, every token trained."""
    return truncate(encode_texts(tokenizer, [text])[0], max_length)


def encode_texts(tokenizer, texts: list[str]) -> list[dict]:
    """encode_text of each text, in one batched tokenizer call (no padding: each row as alone)."""
    if tokenizer.eos_token_id is None:
        raise ValueError(
            f"tokenizer {tokenizer.name_or_path!r} has no eos_token; set eos_token in tokenizer_config.json"
        )
    eos, examples = tokenizer.eos_token_id, []  # a property that costs more than a short row's own work
    encoded = tokenizer(texts, add_special_tokens=True, **_IDS_ONLY)["input_ids"] if texts else []
    for input_ids in encoded:
        input_ids = list(input_ids)
        if not input_ids or input_ids[-1] != eos:
            input_ids.append(eos)
        examples.append({"input_ids": input_ids, "labels": list(input_ids)})
    return examples


def encode_prompt(
    tokenizer, messages: list[dict], tools: list[dict] | None = None, enable_thinking: bool = True,
) -> list[int]:
    """Token ids of a conversation followed by the assistant header, ready for generation."""
    text = render_chat(tokenizer, messages, add_generation_prompt=True, tools=tools, enable_thinking=enable_thinking)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def count_trained_tokens(labels) -> int:
    """Tokens that carry loss: labels != -100, past position 0 (causal LMs never predict the first token)."""
    if isinstance(labels, list) and (not labels or isinstance(labels[0], int)):  # one row: no tensor needed
        return len(labels) - 1 - labels[1:].count(IGNORE_INDEX) if labels else 0
    tensor = torch.as_tensor(labels)
    return int((tensor[..., 1:] != IGNORE_INDEX).sum())
