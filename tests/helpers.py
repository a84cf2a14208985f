"""Test helpers: a character tokenizer for tiny models and a loaded tiny model."""

from __future__ import annotations

from typing import Sequence

from ffkv.memories.view import MemoryView
from ffkv.models.loading import LoadedModel
from tiny_models import VOCAB, tiny_model


class CharTokenizer:
    """One id per character (ids 4..VOCAB-1), optionally a BOS id 1 first; pad id 0."""

    def __init__(self, bos: bool = False, eos: bool = False) -> None:
        self.bos, self.eos = bos, eos

    vocab_size = VOCAB
    pad_id = 0
    special_ids = frozenset({1, 2})

    def encode(self, text: str) -> list[int]:
        ids = [4 + (ord(ch) % (VOCAB - 4)) for ch in text]
        return ([1] if self.bos else []) + ids + ([2] if self.eos else [])

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(self.token_strings(ids))

    def token_strings(self, ids: Sequence[int]) -> list[str]:
        return [{0: "<pad>", 1: "<s>", 2: "</s>"}.get(int(i), chr(int(i) - 4 + 32)) for i in ids]


def loaded_tiny(family: str, seed: int = 0, **tokenizer_options) -> LoadedModel:
    """A tiny model of the family with a character tokenizer, as `load_model` would return it."""
    model = tiny_model(family, seed)
    model.requires_grad_(False)
    return LoadedModel(model, CharTokenizer(**tokenizer_options), MemoryView(model), f"tiny-{family}", "float32", "cpu")
