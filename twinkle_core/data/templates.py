"""Render conversations with a tokenizer's chat template and locate the assistant replies in the text."""
from __future__ import annotations

import functools
import logging
import os

from .errors import ChatTemplateError

logger = logging.getLogger(__name__)

# Used when a tokenizer ships no chat template (base models).
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@functools.cache
def _warn_once(message: str) -> None:
    logger.warning(message)


def render_chat(tokenizer, messages: list[dict], add_generation_prompt: bool = False) -> str:
    """The conversation as text, rendered by the tokenizer's own template (ChatML when it has none)."""
    template = tokenizer.chat_template
    if not template:
        _warn_once(
            f"tokenizer {tokenizer.name_or_path or type(tokenizer).__name__!r} has no chat_template; "
            "using a ChatML default (<|im_start|>role ... <|im_end|>)"
        )
        template = DEFAULT_CHAT_TEMPLATE
    return tokenizer.apply_chat_template(
        messages, chat_template=template, add_generation_prompt=add_generation_prompt, tokenize=False
    )


def assistant_spans(tokenizer, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and, for each assistant reply with text, the character span to train on.

    A span covers the reply's content and the template's end-of-turn marker after it (e.g. `<|im_end|>`),
    but not the role header before it nor the whitespace after the marker.
    """
    full = render_chat(tokenizer, messages)
    spans = [
        _reply_span(tokenizer, messages, index, full)
        for index, message in enumerate(messages)
        if message["role"] == "assistant" and isinstance(message.get("content"), str) and message["content"].strip()
    ]
    return full, spans


def _reply_span(tokenizer, messages: list[dict], index: int, full: str) -> tuple[int, int]:
    """Where reply `index` sits in `full`, found by rendering the prompt before it and the turn itself."""
    prompt = render_chat(tokenizer, messages[:index], add_generation_prompt=True)
    turn = render_chat(tokenizer, messages[: index + 1])
    if not (full.startswith(prompt) and turn.startswith(prompt)):
        raise ChatTemplateError(
            f"the chat template of {tokenizer.name_or_path!r} is not prefix-stable: rendering messages[:{index}] "
            "with add_generation_prompt=True is not the start of the whole conversation, so assistant turns "
            "cannot be located; use a template that renders earlier turns the same way whatever follows them"
        )
    content = messages[index]["content"].strip()  # templates often trim replies
    in_turn = turn.find(content, len(prompt))
    start = full.find(content, len(prompt))
    # Markup may sit between the header and the reply (e.g. an empty <think></think> on the last turn),
    # but the reply cannot start later in the whole conversation than in its own turn.
    if in_turn < 0 or start < 0 or start > in_turn:
        raise ChatTemplateError(
            f"the chat template of {tokenizer.name_or_path!r} rewrites the text of assistant turn messages[{index}]; "
            "its content was not found verbatim after the generation prompt"
        )
    end = start + len(content)
    marker = os.path.commonprefix([turn[in_turn + len(content):], full[end:]]).rstrip()
    if not marker:
        _warn_once(
            f"the chat template of {tokenizer.name_or_path!r} writes no end-of-turn marker after assistant "
            "replies: the model will not learn where a reply stops"
        )
    return start, end + len(marker)
