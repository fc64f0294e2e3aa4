import pytest

from tiny_models import save_tiny_model

ROWS = [
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


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny random Llama with a ChatML tokenizer, as a local Hugging Face directory."""
    return save_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama")


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TWINKLE_CACHE", str(tmp_path / "cache"))
