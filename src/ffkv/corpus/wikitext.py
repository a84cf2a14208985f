"""WikiText as the paper read it: headings, articles, and the tokenized-text escapes.

WikiText files (``wiki.*.tokens``, ``wiki.*.raw``; Merity et al., 2016) hold one
paragraph per line, with headings such as `` = Title = `` (an article starts) and
`` = = Section = = ``, blank lines around them, and numbers escaped as
``1 @,@ 000`` / ``3 @.@ 5`` / ``well @-@ known``.
"""

from __future__ import annotations

import re

_HEADING = re.compile(r"((?:= )+)(.*?)((?: =)+)")
_SPACE_BEFORE = re.compile(r" +([.,;:!?%)\]}])")
_SPACE_AFTER = re.compile(r"([(\[{]) +")
_QUOTED = re.compile(r'" ([^"]*?) "')
_CLITIC = re.compile(r" ('s|'S|'re|'ve|'ll|'d|'m|n't)\b")
_PLURAL_POSSESSIVE = re.compile(r"(\w)s ' ")
_ESCAPES = ((" @-@ ", "-"), (" @,@ ", ","), (" @.@ ", "."), ("@-@", "-"), ("@,@", ","), ("@.@", "."))


def heading_level(line: str) -> int:
    """The heading level of a WikiText line: 1 for `` = Title = ``, 2 for `` = = S = = ``, 0 for text."""
    match = _HEADING.fullmatch(line.strip())
    if match is None or not match.group(2).strip():
        return 0
    left, right = match.group(1).count("="), match.group(3).count("=")
    return left if left == right else 0


def detokenize(text: str) -> str:
    """WikiText's tokenized form to ordinary text, so subword tokenizers see normal spelling.

    ``0 @.@ 7 kg ( 1 @.@ 5 lb ) , " red "`` becomes ``0.7 kg (1.5 lb), "red"``.
    """
    s = text.strip()
    for escaped, plain in _ESCAPES:
        s = s.replace(escaped, plain)
    s = _QUOTED.sub(r'"\1"', s)
    s = _PLURAL_POSSESSIVE.sub(r"\1s' ", s)
    s = _CLITIC.sub(r"\1", s)
    s = _SPACE_BEFORE.sub(r"\1", s)
    s = _SPACE_AFTER.sub(r"\1", s)
    return s
