"""Corpus test fixtures."""

from __future__ import annotations

import pytest

from support.corpus import WordTokenizer


@pytest.fixture
def tok() -> WordTokenizer:
    return WordTokenizer()
