import pytest

from tiny_models import save_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny random Llama with a ChatML tokenizer, as a local Hugging Face directory."""
    return save_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama")
