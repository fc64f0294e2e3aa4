"""Render conversations with a tokenizer's chat template, or a model family's when the tokenizer has none."""
from __future__ import annotations

import functools
import logging
import os
from pathlib import Path

import jinja2

from .chat_templates import chat_template_names, get_chat_template
from .errors import ChatTemplateError
from .messages import normalise_messages

logger = logging.getLogger(__name__)

# Used when a tokenizer ships no chat template and no family template was set (base models).
DEFAULT_CHAT_TEMPLATE = get_chat_template("chatml")

# ensure_chat_template renders this with both templates; it avoids tools and reasoning, which not every family has.
PROBE_CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Italy?"},
    {"role": "assistant", "content": "Rome."},
]


@functools.cache
def warn_once(message: str) -> None:
    logger.warning(message)


def template_owner(tokenizer) -> str:
    """How error messages name the tokenizer whose template is used."""
    return repr(tokenizer.name_or_path or type(tokenizer).__name__)


def render_messages(
    tokenizer, messages: list[dict], add_generation_prompt: bool = False, tools: list[dict] | None = None,
    enable_thinking: bool = True, chat_template: str | None = None,
) -> str:
    """Render already-normalised messages; `chat_template` overrides the tokenizer's own."""
    template = chat_template
    if not template and not tokenizer.chat_template:
        warn_once(f"tokenizer {template_owner(tokenizer)} has no chat_template; using a ChatML default "
                  "(<|im_start|>role ... <|im_end|>)")
        template = DEFAULT_CHAT_TEMPLATE
    try:
        return tokenizer.apply_chat_template(
            messages, tools=tools or None, chat_template=template, add_generation_prompt=add_generation_prompt,
            tokenize=False, enable_thinking=enable_thinking,
        )
    except jinja2.TemplateError as error:
        raise ChatTemplateError(
            f"the chat template of {template_owner(tokenizer)} cannot render this conversation: {error}"
        ) from None


def render_chat(
    tokenizer, messages: list[dict], add_generation_prompt: bool = False, tools: list[dict] | None = None,
    enable_thinking: bool = True,
) -> str:
    """The conversation as text, rendered by the tokenizer's own template (ChatML when it has none).

    enable_thinking=False drops the replies' reasoning and asks the template for its non-thinking mode.
    """
    messages = normalise_messages(messages, enable_thinking)
    return render_messages(tokenizer, messages, add_generation_prompt, tools, enable_thinking)


def _probe(tokenizer, template: str | None) -> str:
    """The probe conversation and its generation prompt, or the error that rendering it raised."""
    try:
        return (render_messages(tokenizer, PROBE_CONVERSATION, chat_template=template)
                + render_messages(tokenizer, PROBE_CONVERSATION[:-1], True, chat_template=template))
    except ChatTemplateError as error:
        return f"<cannot render the probe conversation: {error}>"


def ensure_chat_template(tokenizer, template_name: str) -> bool:
    """Give `tokenizer` the family template `template_name` when it has none; return whether they agree.

    A tokenizer's own template wins: when it renders a probe conversation differently from the family
    template, a warning shows where, the tokenizer keeps its template, and the result is False.
    """
    family = get_chat_template(template_name)
    if not tokenizer.chat_template:
        tokenizer.chat_template = family
        logger.info("tokenizer %s has no chat template; using the %r family template", template_owner(tokenizer),
                    template_name)
        return True
    own, expected = _probe(tokenizer, None), _probe(tokenizer, family)
    if own == expected:
        return True
    at = len(os.path.commonprefix([own, expected]))
    logger.warning(
        "tokenizer %s ships its own chat template, which renders a probe conversation differently from the %r "
        "family template (first difference at character %d: %r here, %r in the family template); keeping the "
        "tokenizer's own template. Check that it is the model's real format.",
        template_owner(tokenizer), template_name, at, own[at:at + 40], expected[at:at + 40],
    )
    return False


def read_chat_template(spec: str) -> str:
    """The Jinja source of a template the user names: one of ours by name, or a .jinja file."""
    if spec in chat_template_names():
        return get_chat_template(spec)
    path = Path(spec).expanduser()
    if path.is_file():
        return path.read_text(encoding="utf-8")
    names = ", ".join(chat_template_names())
    raise ChatTemplateError(f"chat_template={spec!r} is neither one of our templates ({names}) nor an existing "
                            "Jinja file.")


def no_template_message(owner: str) -> str:
    names = ", ".join(chat_template_names())
    return (f"tokenizer {owner} has no chat template, and its model family is not in the tested list, so there is "
            f"no family template to fall back on. Pass --chat-template NAME (one of: {names}) or --chat-template "
            "path/to/template.jinja.")


def use_chat_template(tokenizer, chosen: str | None = None, family_template: str | None = None,
                      required: bool = True) -> None:
    """Give `tokenizer` the template it renders with: the user's `chosen` Jinja source, else its own, else
    the family's; with none of them, `required` raises ChatTemplateError naming --chat-template."""
    if chosen:
        tokenizer.chat_template = chosen
        logger.info("tokenizer %s renders with the chat template the run names", template_owner(tokenizer))
    elif family_template:
        ensure_chat_template(tokenizer, family_template)
    elif not tokenizer.chat_template and required:
        raise ChatTemplateError(no_template_message(template_owner(tokenizer)))
