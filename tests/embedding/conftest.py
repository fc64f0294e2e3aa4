"""Fixtures for the embedding tests: a private cache root (tokenised pairs, the unzipped MiniLM tokenizer)."""
from __future__ import annotations

import pytest


@pytest.fixture(autouse=True, scope="module")
def private_cache(tmp_path_factory):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TWINKLE_CACHE", str(tmp_path_factory.mktemp("cache")))
        yield
