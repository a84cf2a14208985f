"""How ffkv shows tokens: one display for every tokenizer family.

A token reads as the text it adds to a decoded sequence. A word start reads with a leading
space (" the"), whatever marks it in the vocabulary: byte-level BPE's ``Ġ`` (GPT-2, Qwen2,
RoBERTa, ffkv's own BPE), SentencePiece's ``▁`` (Llama, Mistral, stories260K), a WordPiece
token without ``##`` (BERT), every token of a word-level vocabulary (fairseq). A piece inside a
word reads without one ("ing"), so that the tokens of a text, joined, spell the tokenizer's own
decoding of it. Special tokens read as themselves (``<s>``, ``[CLS]``; in WordPiece and
word-level vocabularies they are words like any other).

Two readings, from the same bytes per token:

- `TokenDisplay.vocabulary`: a token on its own (value tokens, chips, tables). A token holding
  part of a multi-byte character (SentencePiece's byte fallback ``<0xE2>``, a byte-level piece of
  one) reads as its bytes, ``<0xE2><0x80>``, so no two tokens read alike.
- `TokenDisplay.sequence`: the tokens of one text (trigger strips, the trace's prompt). A character
  split over several tokens is shown whole on the token that completes it; the tokens before it
  read empty (`PARTIAL`), so the strip joins to the text. Bytes that never complete a character
  read as their bytes.

WordPiece decoders also remove the space before punctuation (" ," -> ","); the display keeps it:
the joined tokens equal the decoding without that clean-up.
"""

from __future__ import annotations

import codecs
import functools
import json
import re
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

#: Decoding error handler: bytes that are not UTF-8 on their own read <0xE2>, as SentencePiece names its byte tokens.
codecs.register_error("ffkv-bytes", lambda e: ("".join(f"<0x{b:02X}>" for b in e.object[e.start:e.end]), e.end))

#: The families `TokenDisplay.from_hf` tells apart (``decoded``: none of them; each token as the tokenizer decodes it).
FAMILIES = ("byte-level", "sentencepiece", "wordpiece", "word", "decoded")
#: What a token of a sequence reads when it holds only the first bytes of a character another token completes.
PARTIAL = ""
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


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


def piece_bytes(piece: str, family: str, prefix: str = "##", byte_fallback: bool = True) -> bytes:
    """The bytes a vocabulary piece adds to a decoded text, by the rule of its tokenizer family.

    Args:
        piece: the token as the vocabulary spells it (``Ġthe``, ``▁the``, ``##ing``, ``<0xE2>``).
        family: one of `FAMILIES` but ``decoded``.
        prefix: WordPiece's continuation prefix.
        byte_fallback: SentencePiece: ``<0xNN>`` is byte NN (Llama's byte fallback).
    """
    if family == "byte-level":
        table = byte_decoder()
        if piece and all(c in table for c in piece):
            return bytes(table[c] for c in piece)
        return piece.encode()  # an added token spelled in plain text
    if family == "sentencepiece":
        found = _BYTE_PIECE.fullmatch(piece) if byte_fallback else None
        return bytes([int(found.group(1), 16)]) if found else piece.replace("▁", " ").encode()
    if family == "wordpiece":
        return piece[len(prefix):].encode() if prefix and piece.startswith(prefix) else (" " + piece).encode()
    if family == "word":
        return (" " + piece).encode()
    raise ValueError(f"no byte rule for tokenizer family {family!r}")


@dataclass
class TokenDisplay:
    """The display of one tokenizer's tokens: each id's bytes, and which ids are special (shown as spelled).

    Args:
        family: one of `FAMILIES`.
        raw: per id, the bytes the token adds to a decoded text; None for special tokens and ids without a piece.
        literal: per id, the text shown where `raw` is None (special tokens, ``<1234>`` past the vocabulary).
    """

    family: str
    raw: list[bytes | None]
    literal: list[str]

    @classmethod
    def from_pieces(cls, pieces: Sequence[str | None], family: str, special: Iterable[int] = (),
                    prefix: str = "##", byte_fallback: bool = True) -> "TokenDisplay":
        """The display of a vocabulary given as its pieces in id order (None: no token at that id)."""
        special = set(int(i) for i in special)
        raw: list[bytes | None] = []
        literal: list[str] = []
        for i, piece in enumerate(pieces):
            if piece is None:
                raw.append(None)
                literal.append(f"<{i}>")
            elif i in special:
                # WordPiece and word-level decoders put a space before every word, special tokens included.
                raw.append((" " + piece).encode() if family in ("wordpiece", "word") else None)
                literal.append(piece)
            else:
                raw.append(piece_bytes(piece, family, prefix, byte_fallback))
                literal.append(piece)
        return cls(family, raw, literal)

    @classmethod
    def from_hf(cls, hf: Any, vocab_size: int | None = None) -> "TokenDisplay":
        """The display of a Hugging Face tokenizer, its family read from its fast backend (model and decoder);
        a tokenizer of no known family shows each token as it decodes alone (``decoded``)."""
        size = int(vocab_size if vocab_size is not None else len(hf))
        n = min(size, len(hf))
        pieces: list[str | None] = list(hf.convert_ids_to_tokens(list(range(n)))) + [None] * (size - n)
        special = {int(i) for i in hf.all_special_ids}
        special |= {int(i) for i, t in getattr(hf, "added_tokens_decoder", {}).items() if getattr(t, "special", False)}
        family, prefix, byte_fallback = hf_family(hf)
        if family == "decoded":
            return cls.decoded(hf, size, special)
        # Added tokens that are not special (a user's words) are plain text, not vocabulary pieces.
        added = {int(i): t.content for i, t in getattr(hf, "added_tokens_decoder", {}).items()
                 if int(i) not in special and int(i) < size}
        display = cls.from_pieces(pieces, family, special, prefix, byte_fallback)
        for i, content in added.items():
            display.raw[i] = content.encode()
        return display

    @classmethod
    def decoded(cls, hf: Any, size: int, special: Iterable[int] = ()) -> "TokenDisplay":
        """Each token as the tokenizer decodes it alone (a family this module does not know)."""
        raw: list[bytes | None] = []
        literal: list[str] = []
        special = set(special)
        for i in range(size):
            try:
                text = hf.decode([i])
            except Exception:  # noqa: BLE001 - ids past the tokenizer's own vocabulary (padded heads)
                raw.append(None)
                literal.append(f"<{i}>")
                continue
            literal.append(text)
            raw.append(None if i in special or "\ufffd" in text else text.encode())
        return cls("decoded", raw, literal)

    def __len__(self) -> int:
        return len(self.raw)

    def _bytes(self, token_id: int) -> bytes | None:
        return self.raw[token_id] if 0 <= token_id < len(self.raw) else None

    def _literal(self, token_id: int) -> str:
        return self.literal[token_id] if 0 <= token_id < len(self.literal) else f"<{token_id}>"

    def vocabulary(self, ids: Iterable[int]) -> list[str]:
        """Each token on its own: its text, with a leading space where it starts a word; bytes of a partial
        character as ``<0xE2>``."""
        out = []
        for i in ids:
            b = self._bytes(int(i))
            out.append(self._literal(int(i)) if b is None else b.decode("utf-8", errors="ffkv-bytes"))
        return out

    def sequence(self, ids: Iterable[int]) -> list[str]:
        """The tokens of one text, in order: joined, they spell its decoding (`PARTIAL` for the leading bytes of a
        character that a later token completes; its whole character on the completing token)."""
        decoder = codecs.getincrementaldecoder("utf-8")(errors="ffkv-bytes")
        out: list[str] = []
        pending: list[tuple[int, int]] = []  # (index in out, its bytes) of bytes waiting for their character

        def flush() -> None:
            """Bytes that never complete a character read as their bytes, on the tokens that hold them."""
            waiting = decoder.getstate()[0]
            decoder.reset()
            for index, n in reversed(pending):
                part, waiting = waiting[len(waiting) - n:], waiting[:len(waiting) - n]
                out[index] += part.decode("utf-8", errors="ffkv-bytes")
            pending.clear()

        for i in ids:
            b = self._bytes(int(i))
            if b is None:
                flush()
                out.append(self._literal(int(i)))
                continue
            text = decoder.decode(b)
            waiting = len(decoder.getstate()[0])
            if text or not waiting:
                pending.clear()  # the earlier waiting bytes made their character (or their <0x..>)
            if waiting:
                pending.append((len(out), min(waiting, len(b))))
            out.append(text)  # PARTIAL ("") while this token's bytes all wait
        flush()
        return out


def hf_family(hf: Any) -> tuple[str, str, bool]:
    """(family, WordPiece prefix, byte fallback) of a Hugging Face tokenizer, from its fast backend's model and
    decoder; ``decoded`` when it has no backend or one this module does not know."""
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is None:
        return "decoded", "##", False
    try:
        spec = json.loads(backend.to_str())
    except Exception:  # noqa: BLE001 - a backend that cannot describe itself
        return "decoded", "##", False
    model = spec.get("model") or {}
    decoders = _parts(spec.get("decoder"))
    kinds = {d.get("type") for d in decoders}
    if "ByteLevel" in kinds:
        return "byte-level", "##", False
    if "WordPiece" in kinds or model.get("type") == "WordPiece":
        prefix = next((d.get("prefix") for d in decoders if d.get("type") == "WordPiece"), None)
        return "wordpiece", prefix or model.get("continuing_subword_prefix") or "##", False
    metaspace = "Metaspace" in kinds or any(
        d.get("type") == "Replace" and (d.get("pattern") or {}).get("String") == "▁" for d in decoders)
    if metaspace:
        return "sentencepiece", "##", "ByteFallback" in kinds or bool(model.get("byte_fallback"))
    if model.get("type") == "WordLevel":
        return "word", "##", False
    return "decoded", "##", False


def _parts(decoder: dict | None) -> list[dict]:
    """A decoder and the decoders of a Sequence, flat."""
    if not decoder:
        return []
    if decoder.get("type") == "Sequence":
        return [part for d in decoder.get("decoders", []) for part in _parts(d)]
    return [decoder]


def sequence_strings(tokenizer: Any, ids: Sequence[int]) -> list[str]:
    """The tokens of one text as `TokenDisplay.sequence` reads them, for any `ffkv.models.Tokenizer`
    (one that offers no ``sequence_strings`` of its own: its `token_strings`)."""
    method = getattr(tokenizer, "sequence_strings", None)
    return list(method(ids)) if method is not None else list(tokenizer.token_strings(ids))


__all__ = ["FAMILIES", "PARTIAL", "TokenDisplay", "byte_decoder", "hf_family", "piece_bytes", "sequence_strings"]
