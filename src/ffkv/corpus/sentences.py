"""A rule-based sentence splitter that needs no model download.

The paper split WikiText-103 paragraphs into sentences (Section 3.1). This splitter
handles ordinary text and WikiText's tokenized form (`` . `` standing alone,
``3 @.@ 5``): a boundary is a run of ``.``, ``!``, ``?`` or ``…``, with any closing
quotes or brackets after it, followed by whitespace and a word that does not start
in lower case; a period after a known abbreviation (Mr., e.g., U.S.) or an initial
(J. R. R. Tolkien) is not a boundary, and decimals (3.5) never are.
"""

from __future__ import annotations

import re

# Lower-cased, without the final period. Words that usually end a sentence when they
# end in a period (etc., Inc. at the end of a name) are left out on purpose.
ABBREVIATIONS = frozenset("""
mr mrs ms dr prof st jr sr sen rep gov gen col lt sgt capt cmdr adm maj rev hon fr
mt ft vs cf ca approx dept
jan feb sept oct nov dec
e.g i.e a.m p.m u.s u.k u.s.a u.n al
""".split())
# Also ordinary words ("no", "art"): abbreviations only before a number (No. 5, Fig. 3).
NUMBER_ABBREVIATIONS = frozenset("no nos vol vols fig figs pp p ch sec art op".split())

_TERMINATOR = re.compile(r"[.!?…]+")
_ACRONYM = re.compile(r"(?:[A-Za-z]\.)+[A-Za-z]")
_OPENERS = "\"'“‘([{«"
_CLOSERS = ")]}”’»"


def split_sentences(text: str) -> list[str]:
    """The sentences of one paragraph, in order, each stripped; none empty."""
    text = text.strip()
    sentences: list[str] = []
    start = 0
    n = len(text)
    for match in _TERMINATOR.finditer(text):
        s, e = match.span()
        if s < start:
            continue
        if "." in match.group() and s > 0 and text[s - 1] == "@" and e < n and text[e] == "@":
            continue  # WikiText's escaped decimal point: 3 @.@ 5
        end = _after_closers(text, start, s, e)
        if end >= n:
            break
        if not text[end].isspace():
            continue  # 3.5, U.S.A, "Hi."he
        nxt = end
        while nxt < n and text[nxt].isspace():
            nxt += 1
        if nxt >= n:
            break
        if text[nxt].islower():
            continue
        if (match.group() == "." and s > start and not text[s - 1].isspace()
                and _is_abbreviation(text, start, s, text[nxt].isdigit())):
            continue
        sentences.append(text[start:end].strip())
        start = nxt
    tail = text[start:].strip()
    if tail:
        sentences.append(tail)
    return sentences


def _after_closers(text: str, start: int, s: int, e: int) -> int:
    """The end of a terminator with the closing quotes/brackets that belong to its sentence.

    In WikiText's tokenized form a closer stands after a space (`` . " ``); a straight
    double quote closes only when the sentence so far has an odd number of them.
    """
    n = len(text)
    quote_open = text.count('"', start, s) % 2 == 1
    j = e
    while j < n:
        k = j + 1 if text[j] == " " and j + 1 < n else j
        ch = text[k]
        if ch in _CLOSERS or (ch == '"' and quote_open):
            quote_open = quote_open and ch != '"'
            j = k + 1
        elif ch == "'" and k == j and (j + 1 >= n or text[j + 1].isspace()):
            j = k + 1  # attached closing single quote: 'Go.'
        else:
            break
    return j


def _is_abbreviation(text: str, start: int, period: int, before_number: bool) -> bool:
    """Whether the word that the period at ``period`` ends is an abbreviation or an initial."""
    word_start = period
    while word_start > start and not text[word_start - 1].isspace():
        word_start -= 1
    word = text[word_start:period].lstrip(_OPENERS)
    if not word:
        return False
    if len(word) == 1 and word.isalpha():
        return True  # an initial: J. R. R. Tolkien, H. gammarus
    lower = word.lower()
    if before_number and lower in NUMBER_ABBREVIATIONS:
        return True
    return lower in ABBREVIATIONS or _ACRONYM.fullmatch(word) is not None
