import pytest

from tiny_models import save_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny random Llama with a ChatML tokenizer, as a local Hugging Face directory. Initialised 15x wider
    than the default (0.3): its next-token distributions are far from uniform, so a few LoRA steps move
    them, as a real model's do (the RL loop's reward can rise)."""
    return save_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama", initializer_range=0.3)
