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
    return PrefixRenderer(tokenizer, messages, tools, enable_thinking, chat_template)(len(messages),
                                                                                      add_generation_prompt)


class PrefixRenderer:
    """Renders prefixes of one conversation, as render_messages would, each (length, generation prompt) once.

    apply_chat_template prepares the messages for the template (None keys dropped, plain copies, reasoning
    aliases) at every call, a third of a short render. For a tokenizer with the stock apply_chat_template, this
    runs transformers' own steps once for the whole conversation (each works message by message, so a prefix of
    the result is the result for the prefix) and renders the compiled template as apply_chat_template does.
    """

    def __init__(self, tokenizer, messages: list[dict], tools: list[dict] | None = None, enable_thinking: bool = True,
                 chat_template: str | None = None):
        self.tokenizer, self.messages, self.enable_thinking = tokenizer, messages, enable_thinking
        self.tools, self.template = tools or None, chat_template
        if not chat_template and not tokenizer.chat_template:
            warn_once(f"tokenizer {template_owner(tokenizer)} has no chat_template; using a ChatML default "
                      "(<|im_start|>role ... <|im_end|>)")
            self.template = DEFAULT_CHAT_TEMPLATE
        self.done: dict[tuple[int, bool], str] = {}
        self._steps = _template_steps(tokenizer, messages, self.tools)
        self._direct = None  # (compiled template, messages, variables, tools), prepared by the first render

    def __call__(self, length: int, add_generation_prompt: bool = False) -> str:
        key = (length, add_generation_prompt)
        if key not in self.done:
            try:
                self.done[key] = self._render(length, add_generation_prompt)
            except jinja2.TemplateError as error:
                raise ChatTemplateError(
                    f"the chat template of {template_owner(self.tokenizer)} cannot render this conversation: {error}"
                ) from None
        return self.done[key]

    def _render(self, length: int, add_generation_prompt: bool) -> str:
        steps = self._steps if length else None
        if steps is None:  # anything else (an empty prefix raises there) goes through apply_chat_template itself
            return self.tokenizer.apply_chat_template(
                self.messages[:length], tools=self.tools, chat_template=self.template,
                add_generation_prompt=add_generation_prompt, tokenize=False, enable_thinking=self.enable_thinking,
            )
        if self._direct is None:  # what apply_chat_template and render_jinja_template do before rendering
            template = self.tokenizer.get_chat_template(self.template, self.tools)
            variables = {**self.tokenizer.special_tokens_map, "enable_thinking": self.enable_thinking}
            messages = steps._alias_reasoning_fields(steps._plain_template_data(
                steps._normalize_chat_messages(self.messages)))
            self._direct = (steps._compile_jinja_template(template), messages, steps._plain_template_data(variables),
                            steps._plain_template_data(self.tools))
        compiled, messages, variables, tools = self._direct
        return compiled.render(messages=messages[:length], tools=tools, documents=None,
                               add_generation_prompt=add_generation_prompt, **variables)


_STEPS = ("_normalize_chat_messages", "_plain_template_data", "_alias_reasoning_fields", "_compile_jinja_template")


@functools.cache
def _transformers_steps():
    """transformers' chat_template_utils and its stock apply_chat_template; None where a version lacks a step."""
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.utils import chat_template_utils
    except ImportError:
        return None
    if not all(hasattr(chat_template_utils, name) for name in _STEPS):
        return None
    return chat_template_utils, PreTrainedTokenizerBase.apply_chat_template


def _template_steps(tokenizer, messages, tools):
    """transformers' template steps where rendering them here equals apply_chat_template: the stock method, one
    conversation of dict messages, tools as JSON schemas (not functions to describe)."""
    found = _transformers_steps()
    if (found is None or getattr(tokenizer.apply_chat_template, "__func__", None) is not found[1]
            or not isinstance(messages, list) or not messages or not isinstance(messages[0], dict)
            or not all(isinstance(tool, dict) for tool in tools or ())):
        return None
    return found[0]


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


PROBE_TOOL = {"type": "function", "function": {"name": "twinkle_probe_tool", "description": "A probe.",
                                               "parameters": {"type": "object", "properties": {}}}}


def renders_tools(tokenizer) -> bool:
    """Whether the tokenizer's chat template writes a conversation's tool schemas into the text: a template without
    a tools block drops them silently. A template that raises on tools (DeepSeek-R1's) counts as rendering none."""
    try:
        text = render_messages(tokenizer, PROBE_CONVERSATION, tools=[PROBE_TOOL])
    except Exception:  # noqa: BLE001 - a probe: whatever the template raises on tools, it renders none
        return False
    return PROBE_TOOL["function"]["name"] in text


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
