"""Corpus test helpers: a word tokenizer and a small WikiText file."""

from __future__ import annotations

import hashlib
from typing import Sequence


class WordTokenizer:
    """Whitespace words to stable hashed ids (4..vocab-1); optionally a BOS id 1 first."""

    vocab_size = 50_000
    pad_id = 0
    special_ids = frozenset({1})

    def __init__(self, bos: bool = False) -> None:
        self.bos = bos
        self.words: dict[int, str] = {1: "<s>"}

    def encode(self, text: str) -> list[int]:
        ids = []
        for word in text.split():
            token = 4 + int.from_bytes(hashlib.blake2b(word.encode(), digest_size=4).digest(), "big") % (
                self.vocab_size - 4)
            self.words[token] = word
            ids.append(token)
        return ([1] if self.bos else []) + ids

    def decode(self, ids: Sequence[int]) -> str:
        return " ".join(self.token_strings(ids))

    def token_strings(self, ids: Sequence[int]) -> list[str]:
        return [self.words.get(int(i), "?") for i in ids]


WIKITEXT = """
 = Alpha Article = 

 Alpha is a 3 @.@ 5 m long thing , made in 1 @,@ 000 units . It is well @-@ known ( mostly ) . 
 Mr. Smith said " it is fine . " Then he left . 

 = = History = = 

 The history is short . 

 = Beta Article = 

 Beta has one line only . 
"""
