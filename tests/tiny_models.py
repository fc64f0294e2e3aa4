"""Tiny real models and tokenizers built inside the tests (no hub, a few seconds each)."""
from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_CORPUS = [
    "You are a helpful assistant. Who are you? I am Twinkle, built by the Twinkle Flows team.",
    "The capital of France is Paris. What is your name? Hello there, how can I help you today?",
    "system user assistant tool thinking answer question model training data token",
    "abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ 0123456789 .,;:!?'\"()[]{}-_/\\@#$%&*+=<>|~`^",
]


def make_tiny_tokenizer(
    vocab_size: int = 384,
    extra_special_tokens: list[str] | tuple[str, ...] = (),
    chat_template: str | None = CHATML_TEMPLATE,
    bos_token: str = "<|im_start|>",
    eos_token: str = "<|im_end|>",
    pad_token: str = "<|endoftext|>",
) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer with ChatML special tokens (plus a family's own) and a chat template.

    `chat_template=None` leaves the template out (the family registry then supplies one).
    """
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(dict.fromkeys([*SPECIAL_TOKENS, bos_token, eos_token, pad_token, *extra_special_tokens])),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=bos_token, eos_token=eos_token, pad_token=pad_token, unk_token=None,
    )
    fast.chat_template = chat_template
    return fast


def make_tiny_causal_lm(model_type: str = "llama", vocab_size: int | None = None, seed: int = 0, **overrides):
    """A random-init causal LM of a real architecture, shrunk to 2 layers and hidden 32."""
    import torch

    tokenizer = make_tiny_tokenizer()
    kwargs = dict(
        vocab_size=vocab_size or len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        tie_word_embeddings=True,
    )
    kwargs.update(overrides)
    config = AutoConfig.for_model(model_type, **kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    return model, tokenizer


def randomize_norms(model) -> None:
    """Norm weights drawn from [0.5, 1.5] (init is ones), so a norm mapped or applied wrongly shows in the logits."""
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)


def save_tiny_model(directory: str | Path, model_type: str = "llama", **overrides) -> Path:
    """Write a tiny model + tokenizer as a normal Hugging Face directory and return it."""
    directory = Path(directory)
    model, tokenizer = make_tiny_causal_lm(model_type, **overrides)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


# A few chats in the row format, with system prompts and multi-turn (used across tests).
SAMPLE_ROWS = [
    {"messages": [{"role": "user", "content": "Who are you?"},
                  {"role": "assistant", "content": "I am Twinkle, built by the Twinkle Flows team."}]},
    {"messages": [{"role": "system", "content": "You are a helpful assistant."},
                  {"role": "user", "content": "What is your name?"},
                  {"role": "assistant", "content": "Twinkle."}]},
    {"messages": [{"role": "user", "content": "The capital of France?"},
                  {"role": "assistant", "content": "Paris."},
                  {"role": "user", "content": "Who made you?"},
                  {"role": "assistant", "content": "The Twinkle Flows team made me."}]},
    {"messages": [{"role": "user", "content": "hello there"},
                  {"role": "assistant", "content": "Hello! I am Twinkle. How can I help you today?"}]},
]

