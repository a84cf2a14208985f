"""One token display for every tokenizer family, checked against each tokenizer's own decoding.

Per family: the tokens of a text, joined, spell the tokenizer's decoding of it (golden); every word
start of the text is visible as a leading space and no piece inside a word has one; a token on its own
reads with its word-start space and partial characters as their bytes.
"""

from __future__ import annotations

import pytest

from ffkv.corpus import shared_data_dir
from ffkv.models.token_display import PARTIAL, TokenDisplay, hf_family, piece_bytes, sequence_strings
from ffkv.models.tokenizer import HFTokenizer

DATA = shared_data_dir()
GPT2 = DATA / "tokenizers" / "gpt2" if DATA else None
STORIES = DATA / "models" / "stories260K" if DATA else None
#: Plain words (each word start must show), a newline, accents, a curly quote, CJK and an em dash.
TEXTS = ("Lucy loved the colour orange and walked home quickly",
         "Once upon a time, there was a little girl.\nShe said: “Café’s naïve 日本 — ok!”")
CORPUS = [
    "Once upon a time there was a little girl named Lucy who loved the colour orange.",
    "She walked home quickly, singing a happy song to her dog and her cat.",
    "The sun was warm and the birds were singing in the tall green trees.",
    "Tom and Lily played with the red ball in the park until it was dark.",
] * 20


def words_visible(tokens: list[str], text: str) -> None:
    """Every word of `text` (plain words, single spaces) begins exactly one token with a space (the first word's
    space may be absent); no other token holds a space."""
    starts = [t for t in tokens if t.startswith(" ")]
    assert len(starts) in (len(text.split()), len(text.split()) - 1), tokens
    assert all(" " not in t[1:] for t in tokens), tokens
    assert "".join(tokens).strip() == text


def check_golden(tok: HFTokenizer, texts=TEXTS, decode=None) -> None:
    decode = decode or tok.decode
    for text in texts:
        ids = tok.encode(text)
        shown = tok.sequence_strings(ids)
        assert len(shown) == len(ids)
        assert "".join(shown).lstrip(" ") == decode(ids).lstrip(" "), (shown, decode(ids))
    plain = texts[0]
    ids = [i for i in tok.encode(plain) if i not in tok.special_ids]
    words_visible(tok.sequence_strings(ids), plain)


# ------------------------------------------------------------------ byte-level BPE
@pytest.mark.skipif(GPT2 is None or not GPT2.is_dir(), reason="GPT-2 tokenizer not in ../shared/data")
def test_gpt2_byte_level_bpe():
    from transformers import AutoTokenizer

    tok = HFTokenizer(AutoTokenizer.from_pretrained(str(GPT2)))
    assert tok.display.family == "byte-level"
    check_golden(tok)
    the, eot = tok.hf.convert_tokens_to_ids(["Ġthe", "<|endoftext|>"])
    assert tok.token_strings([the, eot]) == [" the", "<|endoftext|>"]
    # ’ is three bytes in two tokens: alone each reads as its bytes; in the text, whole on the second.
    ids = tok.encode("’")
    assert tok.token_strings(ids) == ["<0xE2><0x80>", "<0x99>"] and tok.sequence_strings(ids) == [PARTIAL, "’"]
    assert tok.sequence_strings(ids[:1]) == ["<0xE2><0x80>"]  # bytes that never complete read as bytes
    strings = tok.token_strings(range(tok.vocab_size))
    assert len(set(strings)) == tok.vocab_size


def test_ffkv_own_bpe():
    from ffkv.models import load_model
    from ffkv.models.tiny_lm import tiny_path

    if not (tiny_path() / "config.json").is_file():
        pytest.skip("ffkv-tiny checkpoint not built")
    tok = load_model("ffkv-tiny").tokenizer
    assert tok.display.family == "byte-level"
    check_golden(tok, ("In the beginning God created the heaven and the earth",
                       "And God said, Let there be light: and there was light.\nCafé – naïve"))
    assert tok.token_strings(tok.encode("<s>")) == ["<s>", "<s>"]


# ------------------------------------------------------------------ SentencePiece
def llama_style_tokenizer():
    """A tiny Llama-style SentencePiece BPE with byte fallback (▁ word starts, <0xNN> byte tokens in the
    vocabulary), built here."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first", split=True)
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=420, special_tokens=["<unk>", "<s>", "</s>",
                                                                                        *byte_tokens],
                                                        show_progress=False))
    spec = json.loads(tok.to_str())  # byte tokens are vocabulary entries, not special tokens (as in Llama's)
    spec["added_tokens"] = [t for t in spec["added_tokens"] if t["content"] not in byte_tokens]
    tok = Tokenizer.from_str(json.dumps(spec))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return HFTokenizer(PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                               unk_token="<unk>", clean_up_tokenization_spaces=False))


def metaspace_unigram_tokenizer():
    """A tiny T5-style SentencePiece Unigram (Metaspace pre-tokenizer and decoder, no byte fallback)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.Unigram())
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator(CORPUS, trainers.UnigramTrainer(vocab_size=150, special_tokens=["<pad>", "</s>", "<unk>"],
                                                            unk_token="<unk>", show_progress=False))
    return HFTokenizer(PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>",
                                               unk_token="<unk>", clean_up_tokenization_spaces=False))


def test_sentencepiece_with_byte_fallback():
    tok = llama_style_tokenizer()
    assert tok.display.family == "sentencepiece" and hf_family(tok.hf)[2]  # byte fallback read from the decoder
    check_golden(tok)
    ids = tok.encode("日")  # not in the vocabulary: three byte tokens
    pieces = tok.hf.convert_ids_to_tokens(ids)
    assert pieces[-3:] == ["<0xE6>", "<0x97>", "<0xA5>"]
    assert tok.token_strings(ids[-3:]) == ["<0xE6>", "<0x97>", "<0xA5>"]
    assert tok.sequence_strings(ids[-3:]) == [PARTIAL, PARTIAL, "日"]
    the = tok.hf.convert_tokens_to_ids("▁the")
    assert tok.token_strings([the, 1]) == [" the", "<s>"]


def test_sentencepiece_metaspace_unigram():
    tok = metaspace_unigram_tokenizer()
    assert tok.display.family == "sentencepiece"
    check_golden(tok, (TEXTS[0], "She walked home, singing a happy song."))


@pytest.mark.skipif(STORIES is None or not STORIES.is_dir(), reason="stories260K not in ../shared/data")
def test_stories260k_sentencepiece():
    """The real Llama-style tokenizer: the issue's example reads with its spaces."""
    from transformers import AutoTokenizer

    tok = HFTokenizer(AutoTokenizer.from_pretrained(str(STORIES)))
    assert tok.display.family == "sentencepiece"
    check_golden(tok)
    ids = tok.encode("You have a big")  # the JSON export read ['Y', 'ou', 'ha', 've', 'a', 'big']
    assert tok.sequence_strings(ids)[1:] == [" ", "Y", "ou", " ha", "ve", " a", " big"]
    assert "".join(tok.sequence_strings(tok.encode("Lucy loved the color orange."))) == \
        "<s> Lucy loved the color orange."


# ------------------------------------------------------------------ WordPiece
def wordpiece_tokenizer():
    """A tiny BERT WordPiece tokenizer (## continuations), built here."""
    from tokenizers import BertWordPieceTokenizer
    from transformers import BertTokenizerFast

    tok = BertWordPieceTokenizer(lowercase=True)
    tok.train_from_iterator(CORPUS, vocab_size=200, show_progress=False)
    return HFTokenizer(BertTokenizerFast(tokenizer_object=tok._tokenizer))


def test_wordpiece():
    from tokenizers import decoders

    tok = wordpiece_tokenizer()
    assert tok.display.family == "wordpiece"
    # BERT's decoder also removes the space before punctuation; the display keeps it (its decoding without clean-up).
    plain = decoders.WordPiece(prefix="##", cleanup=False)
    check_golden(tok, (TEXTS[0].lower(), "she walked home, quickly! singing."),
                 decode=lambda ids: plain.decode(tok.hf.convert_ids_to_tokens(ids)))
    ids = tok.encode("walking")
    pieces = tok.hf.convert_ids_to_tokens(ids)
    assert pieces[0] == "[CLS]" and any(p.startswith("##") for p in pieces)
    shown = tok.sequence_strings(ids)
    assert shown[0] == " [CLS]" and shown[-1] == " [SEP]" and "".join(shown[1:-1]) == " walking"
    assert not any("#" in s for s in shown)


# ------------------------------------------------------------------ word-level
def test_word_level_fairseq_dictionary():
    from ffkv.models.fairseq_lm import FairseqDictTokenizer

    tok = FairseqDictTokenizer(["<s>", "<pad>", "</s>", "<unk>", "the", "cat", "sat", "@-@"])
    ids = tok.encode("the cat sat")
    assert tok.sequence_strings(ids) == [" </s>", " the", " cat", " sat"]
    assert "".join(tok.sequence_strings(ids)).lstrip() == tok.decode(ids)


# ------------------------------------------------------------------ the rules themselves
def test_piece_rules():
    assert piece_bytes("Ġthe", "byte-level") == b" the" and piece_bytes("âĢ", "byte-level") == b"\xe2\x80"
    assert piece_bytes("▁the", "sentencepiece") == b" the" and piece_bytes("<0x0A>", "sentencepiece") == b"\n"
    assert piece_bytes("<0x0A>", "sentencepiece", byte_fallback=False) == b"<0x0A>"
    assert piece_bytes("##ing", "wordpiece") == b"ing" and piece_bytes("walk", "wordpiece") == b" walk"
    assert piece_bytes("the", "word") == b" the"
    display = TokenDisplay.from_pieces(["<s>", "▁caf", "<0xC3>", "<0xA9>", None], "sentencepiece", special=[0])
    assert display.vocabulary([0, 1, 2, 3, 4, 99]) == ["<s>", " caf", "<0xC3>", "<0xA9>", "<4>", "<99>"]
    assert display.sequence([0, 1, 2, 3]) == ["<s>", " caf", PARTIAL, "é"]
    # A character cut by a special token, or by the end, reads as its bytes on the tokens that hold them.
    assert display.sequence([1, 2, 0, 3]) == [" caf", "<0xC3>", "<s>", "<0xA9>"]
    assert "".join(display.sequence([2, 2, 3])) == "<0xC3>é"  # a byte that is not UTF-8 here reads as its byte


def test_sequence_strings_of_any_tokenizer():
    """A tokenizer without a sequence reading of its own (a test's character tokenizer) reads token by token."""
    from support.helpers import CharTokenizer

    tok = CharTokenizer()
    ids = tok.encode("ab")
    assert sequence_strings(tok, ids) == tok.token_strings(ids)
