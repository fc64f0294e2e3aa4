"""Fixtures for the data tests: a tiny tokenizer and a private cache root."""
from __future__ import annotations

import pytest
from tiny_models import make_tiny_tokenizer


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    """Keep every cache write of these tests out of the home cache."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("TWINKLE_CACHE", str(cache))
    return cache


@pytest.fixture(scope="session")
def tokenizer():
    return make_tiny_tokenizer()


@pytest.fixture
def conversation():
    return [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Who are you?"},
        {"role": "assistant", "content": "I am Twinkle."},
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris."},
    ]
