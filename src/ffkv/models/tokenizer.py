"""The tokenizer contract every model family provides to ffkv.

Hugging Face tokenizers, ffkv's own word tokenizer and the fairseq dictionary all
present this one small interface, so the corpus and the experiments never ask
which kind they hold.
"""

from __future__ import annotations

import codecs
import functools
from typing import Protocol, Sequence, runtime_checkable

#: Decoding error handler: bytes that are not UTF-8 on their own read <0xE2>, as SentencePiece names its byte tokens.
codecs.register_error("ffkv-bytes", lambda e: ("".join(f"<0x{b:02X}>" for b in e.object[e.start:e.end]), e.end))


@functools.cache
def byte_decoder() -> dict[str, int]:
    """The inverse of GPT-2's byte-level alphabet (each byte drawn as one printable character), shared by every
    byte-level BPE tokenizer (GPT-2, RoBERTa, GPT-NeoX, Llama 3, Qwen2, ffkv's own)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


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
        """One readable string per id (for tables and figures)."""


class HFTokenizer:
    """A Hugging Face tokenizer behind ffkv's `Tokenizer` contract."""

    def __init__(self, hf_tokenizer, vocab_size: int | None = None) -> None:
        self.hf = hf_tokenizer
        self._vocab_size = int(vocab_size if vocab_size is not None else len(hf_tokenizer))
        pad = hf_tokenizer.pad_token_id
        if pad is None:
            pad = hf_tokenizer.eos_token_id if hf_tokenizer.eos_token_id is not None else 0
        self._pad_id = int(pad)

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

    def token_strings(self, ids: Sequence[int]) -> list[str]:
        """Each token's decoded text; a token holding part of a multi-byte character (which decodes to U+FFFD
        alone) as its bytes, e.g. ``<0xE2><0x80>``, so that different byte tokens never read alike."""
        out = []
        for i in ids:
            text = self.hf.decode([int(i)])
            out.append(self._bytes_text(int(i), text) if "\ufffd" in text else text)
        return out

    def _bytes_text(self, token_id: int, decoded: str) -> str:
        piece = self.hf.convert_ids_to_tokens(token_id)
        if not isinstance(piece, str) or not piece:
            return decoded
        table = byte_decoder()
        if all(c in table for c in piece):  # byte-level BPE: the piece spells the token's bytes
            return bytes(table[c] for c in piece).decode("utf-8", errors="ffkv-bytes")
        return piece  # SentencePiece names its byte tokens <0xE2> itself
