"""Find each assistant reply in a rendered conversation: the character spans that carry the loss."""
from __future__ import annotations

import functools
from dataclasses import dataclass

from .errors import ChatTemplateError
from .messages import THINK_CLOSE, normalise_messages
from .templates import PrefixRenderer, template_owner, warn_once


@dataclass(frozen=True)
class _Turn:
    """Reply messages[index] as rendered when it is the last message: `prompt` (the conversation before it with
    the generation prompt), the reasoning block `lead` (templates drop it from earlier turns) and the `tail`
    (content, tool calls, marker)."""

    index: int
    prompt: str
    lead: str
    tail: str


def assistant_spans(
    tokenizer, messages: list[dict], tools: list[dict] | None = None, enable_thinking: bool = True,
) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and, for each assistant reply, the character span to train on.

    A span is what the model writes after the generation prompt (the reasoning block where the template keeps
    it, the content, the tool-call encoding) and the end-of-turn marker after it (`<|im_end|>`, `<|eot_id|>`,
    `</s>`, ...), but not the role header nor the whitespace after the marker. Templates that drop earlier
    replies' reasoning or move the system prompt render a conversation differently from its prefixes, so the
    whole conversation is rendered once and the replies are searched for in it, in order; rendering the
    conversation up to a reply only shows what that reply looks like.
    """
    messages = normalise_messages(messages, enable_thinking)
    # The last reply's turn is the whole conversation, rendered here once: a one-turn row renders twice.
    render = PrefixRenderer(tokenizer, messages, tools, enable_thinking)
    text = render(len(messages))
    specials = _special_tokens(tokenizer)
    spans: list[tuple[int, int]] = []
    cursor = 0  # everything before it belongs to earlier messages
    for index, message in enumerate(messages):
        if message["role"] == "system":
            continue  # some templates move it (Mistral: into the last user turn); it is never trained
        if message["role"] != "assistant" or index == 0:
            if index == 0 and message["role"] == "assistant":
                warn_once("a conversation opens with an assistant reply; it answers nothing and is not trained")
            cursor = _skip_past(text, message.get("content"), cursor)
            continue
        turn = _render_turn(tokenizer, render, messages, index)
        if turn is None:
            continue
        start, end = _locate(tokenizer, text, turn, cursor, functools.partial(render, index))
        text, end = _close_turn(tokenizer, text, turn.tail, end, specials)
        spans.append((start, end))
        cursor = end
    return text, spans


def _render_turn(tokenizer, render, messages: list[dict], index: int) -> _Turn | None:
    """What reply `index` looks like; None when the template writes nothing for it."""
    prompt = render(index, add_generation_prompt=True)
    whole = render(index + 1)
    if not whole.startswith(prompt):
        raise ChatTemplateError(
            f"the chat template of {template_owner(tokenizer)} is not prefix-stable: messages[:{index}] rendered "
            f"with add_generation_prompt=True is not the start of messages[:{index + 1}], so the reply "
            f"messages[{index}] cannot be told apart from its prompt; use a template whose generation prompt is "
            "the start of the reply it introduces"
        )
    reply = whole[len(prompt):].rstrip()
    if not reply:
        return None
    message = messages[index]
    reasoning = message.get("reasoning_content", "").strip()
    if reasoning and reasoning not in reply:
        warn_once(f"the chat template of {template_owner(tokenizer)} does not render reasoning_content; "
                  "the replies' reasoning is not trained")
    lead, tail = _split_reasoning(reply, message["content"].strip())
    return _Turn(index, prompt, lead, tail)


def _split_reasoning(reply: str, content: str) -> tuple[str, str]:
    """(reasoning block up to `</think>` and the whitespace after it, the rest) of a rendered reply."""
    close = reply.find(THINK_CLOSE)
    if close < 0 or (content and content not in reply[close:]):
        return "", reply
    cut = close + len(THINK_CLOSE)
    cut += len(reply[cut:]) - len(reply[cut:].lstrip())
    if cut == len(reply):  # a reply of reasoning only: nothing of it survives in history form
        return "", reply
    return reply[:cut], reply[cut:]


def _locate(tokenizer, text: str, turn: _Turn, cursor: int, render_history) -> tuple[int, int]:
    """The span of the reply in `text`: with its reasoning block when the text has it after the generation prompt
    (what the prompt adds to `render_history()`, which is rendered only for a reply with reasoning)."""
    at = text.find(turn.tail, cursor)
    if at < 0:
        raise ChatTemplateError(
            f"the chat template of {template_owner(tokenizer)} renders reply messages[{turn.index}] as "
            f"{turn.tail[:80]!r} when it ends the conversation, but not when later messages follow it; "
            "the template rewrites earlier replies in a way the label masking cannot follow"
        )
    if turn.lead:
        history = render_history()
        lead = (turn.prompt[len(history):] if turn.prompt.startswith(history) else "") + turn.lead
        if at >= len(lead) and text[at - len(lead):at] == lead:
            return at - len(turn.lead), at + len(turn.tail)
    return at, at + len(turn.tail)


def _close_turn(tokenizer, text: str, tail: str, end: int, specials: tuple[str, ...]) -> tuple[str, int]:
    """Extend a reply's span over the token that ends it, which the model must learn to write to stop.

    Most templates end a reply with their own marker. GLM-4's ends where the next role token starts, and its
    generation config stops on those (<|user|>, <|observation|>), so the following special token is trained;
    after the last reply there is none, so the tokenizer's eos token is appended and trained, as GLM's own
    fine-tuning code does.
    """
    if tail.endswith(specials):
        return text, end
    following = next((token for token in specials if text.startswith(token, end)), None)
    if following:
        return text, end + len(following)
    eos = tokenizer.eos_token
    if eos and not text[end:].strip():
        return text[:end] + eos + text[end:], end + len(eos)
    warn_once(f"the chat template of {template_owner(tokenizer)} writes no end-of-turn token after assistant "
              "replies and the tokenizer has no eos_token: the model will not learn where a reply stops")
    return text, end


def _special_tokens(tokenizer) -> tuple[str, ...]:
    """The tokenizer's special tokens, longest first so that a token is never matched by its prefix."""
    tokens = {token.content for token in tokenizer.added_tokens_decoder.values() if token.special}
    return tuple(sorted(tokens, key=len, reverse=True))


def _skip_past(text: str, content, cursor: int) -> int:
    """Move past a prompt message's text, so a reply that repeats it is not found there."""
    needle = content.strip() if isinstance(content, str) else ""
    at = text.find(needle, cursor) if needle else -1
    return cursor if at < 0 else at + len(needle)
