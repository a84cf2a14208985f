"""Corpus test fixtures."""

from __future__ import annotations

import pytest

from corpus_helpers import WordTokenizer


@pytest.fixture
def tok() -> WordTokenizer:
    return WordTokenizer()
