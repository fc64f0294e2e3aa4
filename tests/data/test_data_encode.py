"""Chat and text encoding: which tokens are trained, with several chat templates."""
from __future__ import annotations

import copy
import logging

import pytest
from tokenizers import processors

from twinkle_core.data import ChatTemplateError, encode_chat, encode_prompt, encode_text

# Like SmolLM2-Instruct: a default system prompt when the conversation brings none.
DEFAULT_SYSTEM_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM<|im_end|>\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Like Llama 3 / Gemma: contents trimmed, a BOS written by the template.
TRIMMING_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + (message['content'] | trim) + '<|im_end|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Like Qwen3: replies after the last user message get an empty think block, earlier ones do not.
THINKING_TEMPLATE = (
    "{% set ns = namespace(last_query=-1) %}"
    "{% for message in messages %}{% if message['role'] == 'user' %}{% set ns.last_query = loop.index0 %}"
    "{% endif %}{% endfor %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' and loop.index0 > ns.last_query %}"
    "{{ '<|im_start|>assistant\n<think>\n\n</think>\n\n' + message['content'] + '<|im_end|>\n' }}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Not prefix-stable: the header depends on the number of messages.
COUNTING_TEMPLATE = (
    "{{ 'turns: ' + (messages | length | string) + '\n' }}"
    "{% for message in messages %}{{ message['role'] + ': ' + message['content'] + '<|im_end|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
)


def _runs(tokenizer, encoded, trained):
    """Decoded runs of consecutive trained (or untrained) tokens."""
    runs, current = [], []
    for token, label in zip(encoded["input_ids"], encoded["labels"]):
        if (label != -100) == trained:
            current.append(token)
        elif current:
            runs.append(tokenizer.decode(current))
            current = []
    if current:
        runs.append(tokenizer.decode(current))
    return runs


def _with_template(tokenizer, template):
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.chat_template = template
    return tokenizer


def test_only_assistant_replies_and_their_end_token_are_trained(tokenizer, conversation):
    encoded = encode_chat(tokenizer, conversation)
    assert len(encoded["input_ids"]) == len(encoded["labels"])
    assert all(label in (-100, token) for token, label in zip(encoded["input_ids"], encoded["labels"]))
    assert _runs(tokenizer, encoded, trained=True) == ["I am Twinkle.<|im_end|>", "Paris.<|im_end|>"]
    assert _runs(tokenizer, encoded, trained=False) == [
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nWho are you?<|im_end|>\n"
        "<|im_start|>assistant\n",
        "\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
        "\n",
    ]


def test_template_with_default_system_prompt(tokenizer, conversation):
    smol = _with_template(tokenizer, DEFAULT_SYSTEM_TEMPLATE)
    encoded = encode_chat(smol, conversation[1:])  # no system message: the template adds one
    assert _runs(smol, encoded, trained=True) == ["I am Twinkle.<|im_end|>", "Paris.<|im_end|>"]
    assert _runs(smol, encoded, trained=False)[0].startswith(
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM<|im_end|>\n<|im_start|>user\nWho are you?"
    )


def test_trimming_template_whose_tokenizer_also_adds_bos(tokenizer, conversation):
    trimming = _with_template(tokenizer, TRIMMING_TEMPLATE)
    trimming.bos_token = "<|endoftext|>"
    # Like Llama 3: tokenizer(text) prepends BOS too, so encoding must not add a second one.
    trimming._tokenizer.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", trimming.bos_token_id)]
    )
    assert trimming("Paris.")["input_ids"][0] == trimming.bos_token_id
    messages = copy.deepcopy(conversation)
    messages[2]["content"] = "  I am Twinkle.\n"
    encoded = encode_chat(trimming, messages)
    assert encoded["input_ids"].count(trimming.bos_token_id) == 1
    assert _runs(trimming, encoded, trained=True) == ["I am Twinkle.<|im_end|>", "Paris.<|im_end|>"]
    assert _runs(trimming, encoded, trained=False)[0] == (
        "<|endoftext|><|im_start|>system\nYou are a helpful assistant.<|im_end|>"
        "<|im_start|>user\nWho are you?<|im_end|><|im_start|>assistant\n"
    )


def test_template_that_renders_the_last_reply_differently(tokenizer, conversation):
    thinking = _with_template(tokenizer, THINKING_TEMPLATE)
    encoded = encode_chat(thinking, conversation)
    # The generation prompt stops at the header, so the model itself must write the (empty) think block.
    assert _runs(thinking, encoded, trained=True) == ["I am Twinkle.<|im_end|>",
                                                      "<think>\n\n</think>\n\nParis.<|im_end|>"]
    assert _runs(thinking, encoded, trained=False)[1].endswith("<|im_start|>assistant\n")


def test_template_that_is_not_prefix_stable_is_rejected(tokenizer, conversation):
    with pytest.raises(ChatTemplateError, match="prefix-stable"):
        encode_chat(_with_template(tokenizer, COUNTING_TEMPLATE), conversation)


def test_tokenizer_without_template_uses_chatml_and_warns_once(tokenizer, conversation, caplog):
    bare = _with_template(tokenizer, None)
    bare.name_or_path = "bare-for-warning-test"
    with caplog.at_level(logging.WARNING, logger="twinkle_core.data"):
        first = encode_chat(bare, conversation)
        encode_chat(bare, conversation)
    assert first == encode_chat(tokenizer, conversation)  # the tiny template is ChatML too
    assert sum("has no chat_template" in record.message for record in caplog.records) == 1


def test_truncation_keeps_the_first_tokens(tokenizer, conversation):
    full = encode_chat(tokenizer, conversation)
    cut = encode_chat(tokenizer, conversation, max_length=40)
    assert len(full["input_ids"]) > 40
    assert cut == {"input_ids": full["input_ids"][:40], "labels": full["labels"][:40]}
    assert encode_chat(tokenizer, conversation, max_length=10_000) == full


def test_prompt_is_the_conversation_up_to_the_reply(tokenizer, conversation):
    prompt = encode_prompt(tokenizer, conversation[:2])
    assert tokenizer.decode(prompt).endswith("Who are you?<|im_end|>\n<|im_start|>assistant\n")
    full = encode_chat(tokenizer, conversation)
    assert full["input_ids"][: len(prompt)] == prompt
    assert set(full["labels"][: len(prompt)]) == {-100}
    assert full["labels"][len(prompt)] != -100


def test_text_rows_train_every_token_and_end_with_eos(tokenizer):
    encoded = encode_text(tokenizer, "The capital of France is Paris.")
    assert encoded["labels"] == encoded["input_ids"]
    assert tokenizer.decode(encoded["input_ids"]) == "The capital of France is Paris.<|im_end|>"
    cut = encode_text(tokenizer, "The capital of France is Paris.", max_length=3)
    assert cut["input_ids"] == encoded["input_ids"][:3] == cut["labels"]


def test_reply_labels_from_the_span_ends_equal_every_tokens_offsets(tokenizer):
    """encode_chats labels a reply through the tokens at its two ends (char_to_token, widened over byte-level
    tokens that share a character); every token's offsets (_reply_labels) give the same labels for any spans,
    over text with multi-byte characters that byte-level BPE splits into several tokens."""
    import random

    from twinkle_core.data.encode import _labelled, _reply_labels

    text = "Héllo wörld ✨ 你好，世界 🎉🎉 ok<|im_end|>\n<|im_start|>assistant\nÇa va? 🙂 日本語<|im_end|>"
    encoding = tokenizer.backend_tokenizer.encode(text, add_special_tokens=False)
    assert len(encoding.ids) > len(text.encode()) // 4  # multi-byte characters are split
    rng = random.Random(0)
    for _ in range(400):
        cuts = sorted(rng.sample(range(len(text) + 1), 2 * rng.randint(1, 3)))
        spans = [(a, b) for a, b in zip(cuts[0::2], cuts[1::2]) if b > a]
        want = _reply_labels(encoding.ids, encoding.offsets, spans)
        assert _labelled(encoding, spans)["labels"] == want, spans
