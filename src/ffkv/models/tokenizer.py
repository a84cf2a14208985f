"""The tokenizer contract every model family provides to ffkv.

Hugging Face tokenizers, ffkv's own word tokenizer and the fairseq dictionary all
present this one small interface, so the corpus and the experiments never ask
which kind they hold.
"""

from __future__ import annotations

from typing import Protocol, Sequence, runtime_checkable

from ffkv.models.token_display import TokenDisplay


@runtime_checkable
class Tokenizer(Protocol):
    """Text to token ids and back, as the analysed model sees them."""

    @property
    def vocab_size(self) -> int:
        """Number of rows of the output embedding E."""

    @property
    def pad_id(self) -> int:
        """An id safe to place in padded positions (never reaches a result)."""

    @property
    def special_ids(self) -> frozenset[int]:
        """Ids of special tokens (BOS, EOS, CLS, SEP, ...): prefixes ending in them never compete."""

    def encode(self, text: str) -> list[int]:
        """Token ids of one example, with the special tokens the model expects at its start."""

    def decode(self, ids: Sequence[int]) -> str:
        """Readable text of a list of ids."""

    def token_strings(self, ids: Sequence[int]) -> list[str]:
        """One readable string per id (for tables and figures): a word start with its leading space, " the"
        (`ffkv.models.token_display`). A tokenizer may also offer ``sequence_strings(ids)``, the tokens of one
        text joined to its decoding (`ffkv.models.token_display.sequence_strings`)."""


class HFTokenizer:
    """A Hugging Face tokenizer behind ffkv's `Tokenizer` contract."""

    def __init__(self, hf_tokenizer, vocab_size: int | None = None) -> None:
        self.hf = hf_tokenizer
        self._vocab_size = int(vocab_size if vocab_size is not None else len(hf_tokenizer))
        pad = hf_tokenizer.pad_token_id
        if pad is None:
            pad = hf_tokenizer.eos_token_id if hf_tokenizer.eos_token_id is not None else 0
        self._pad_id = int(pad)
        self._display: TokenDisplay | None = None

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def pad_id(self) -> int:
        return self._pad_id

    @property
    def special_ids(self) -> frozenset[int]:
        return frozenset(int(i) for i in self.hf.all_special_ids)

    def encode(self, text: str) -> list[int]:
        return list(self.hf(text, add_special_tokens=True)["input_ids"])

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """`encode` of several texts at once (parallel in fast tokenizers)."""
        return [list(ids) for ids in self.hf(texts, add_special_tokens=True)["input_ids"]]

    def decode(self, ids: Sequence[int]) -> str:
        return self.hf.decode(list(ids))

    @property
    def display(self) -> TokenDisplay:
        """How this tokenizer's tokens read (`ffkv.models.token_display`), built on first use."""
        if self._display is None:
            self._display = TokenDisplay.from_hf(self.hf, self._vocab_size)
        return self._display

    def token_strings(self, ids: Sequence[int]) -> list[str]:
        """Each token on its own (`TokenDisplay.vocabulary`): " the" where it starts a word, whatever the
        tokenizer family's marker; a token holding part of a multi-byte character as its bytes, ``<0xE2><0x80>``."""
        return self.display.vocabulary(ids)

    def sequence_strings(self, ids: Sequence[int]) -> list[str]:
        """The tokens of one text (`TokenDisplay.sequence`): joined, its decoding; a character split over
        several tokens shown whole on the one that completes it."""
        return self.display.sequence(ids)
