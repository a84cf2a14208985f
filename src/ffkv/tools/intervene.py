"""Interventions over a corpus (docs/definitions.md; Geva et al. 2022): switch memories off, scale them or set
their coefficient at every position, and measure what changes on held-out text.

Each evaluation example runs twice, as it is and with the memories rewritten (`ffkv.memories.intervene`,
which rewrites m_i at every position; leaving it restores the model exactly). Per example
(`ffkv.experiments.scoring`): the mean token NLL and the mean probability p(S) the final distribution
gives to a token set S. Reported, with n (examples) and 95% intervals of the paired per-example
differences (mean ± 1.96·s/√n, `ffkv.presentation.intervals.paired_mean_interval`):

- perplexity: exp of the token-weighted mean NLL, before and after (the change in mean NLL per example
  carries the interval);
- mass: the mean over examples of p(S), before and after, and the mean per-example change.

S is the user's token set, or by default the union of the intervened memories' own top tokens: the
`DEFAULT_TOP` tokens with the largest v_i·Eᵀ (identity projection, the paper's), or the smallest for a
memory set to a negative value (it then writes -v_i).

Memories and edits are written as everywhere else (`ffkv.memories.address`): LAYER:KEY with LAYER counted from
1 on the command line, from 0 in code (`Intervention`), as the run's tables do.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pandas as pd
import pyarrow as pa
import torch

from ffkv.corpus import CorpusSpec, iter_examples
from ffkv.errors import FfkvError
from ffkv.experiments.common import text_measured
from ffkv.experiments.scoring import Scores, perplexity, score_examples
from ffkv.memories.address import edit_ref
from ffkv.memories.interventions import Intervention
from ffkv.memories.sets import memories_of
from ffkv.memories.projection import top_tokens
from ffkv.models.loading import LoadedModel
from ffkv.presentation.intervals import paired_mean_interval
from ffkv.store import atomic

#: Tokens per intervened memory in the default token set.
DEFAULT_TOP = 10
INTERVAL = "95% interval of the mean paired per-example difference, mean ± 1.96·s/√n (normal approximation)"


@torch.no_grad()
def own_top_tokens(loaded: LoadedModel, interventions: Sequence[Intervention], n: int = DEFAULT_TOP) -> list[int]:
    """The union of each intervened memory's own top n tokens of v_i·Eᵀ (identity projection); the bottom n
    for a memory set to a negative value, which writes -v_i."""
    tokens: set[int] = set()
    for edit in interventions:
        sign = -1 if edit.op == "set" and edit.value < 0 else 1
        own = top_tokens(loaded.view, edit.layer, [edit.key], n, "identity", sign,
                         memories=memories_of(loaded.view, edit.kind))
        tokens.update(int(i) for i in own[0][0])
    return sorted(tokens)


def token_ids(loaded: LoadedModel, tokens: str | Sequence[str | int]) -> list[int]:
    """Token ids of a comma-separated string or a list: each item an int id, or a string that the
    tokenizer encodes to exactly one token (as it reads in text, e.g. with its leading space)."""
    items = [t for t in (tokens.split(",") if isinstance(tokens, str) else tokens)]
    out = []
    special = loaded.special_ids
    for item in items:
        if isinstance(item, (int, np.integer)):
            out.append(int(item))
            continue
        if item == "":
            continue
        ids = [i for i in loaded.tokenizer.encode(item) if int(i) not in special]
        if len(ids) != 1:
            shown = loaded.tokenizer.token_strings(ids) if ids else []
            raise FfkvError(f"token {item!r} is not one token of this model's vocabulary (it encodes to {shown}); "
                            "give single tokens, or token ids")
        out.append(int(ids[0]))
    if not out:
        raise FfkvError("--tokens names no token")
    bad = [i for i in out if not 0 <= i < loaded.view.vocab_size]
    if bad:
        raise FfkvError(f"token id {bad[0]} does not exist: ids are 0..{loaded.view.vocab_size - 1}")
    return sorted(set(out))


@dataclass
class InterventionResult:
    """What an intervention changes over a corpus.

    Attributes:
        summary: one row per measure (perplexity, mean NLL, token-set mass): before, after, change, the
            change's 95% interval, n.
        examples: per example: example_id, n_predicted, nll / mass before and after.
        interventions: what was rewritten (layers from 0).
        token_set: the ids of S; token_strings: their strings; token_set_origin: "given" or "own top tokens".
    """

    summary: pd.DataFrame
    examples: pd.DataFrame
    interventions: list[Intervention]
    token_set: list[int]
    token_strings: list[str]
    token_set_origin: str
    corpus: dict = field(default_factory=dict)

    def description(self) -> dict:
        """The JSON description written beside the result (and in the Parquet metadata)."""
        return {"interventions": [{"layer": e.layer, "layer_number": e.layer + 1, "key": e.key, "op": e.op,
                                   "value": e.value, "kind": e.kind, "memory": str(edit_ref(e))}
                                  for e in self.interventions],
                "token_set": self.token_set, "token_strings": self.token_strings,
                "token_set_origin": self.token_set_origin, "interval": INTERVAL,
                "n_examples": int(len(self.examples)), "corpus": self.corpus,
                "layers": "layer counts from 0; layer_number from 1 (as the command line, explorer and report)"}

    def write(self, path: str | Path) -> Path:
        """Write the result atomically: ``.json`` (description, summary and per-example rows) or ``.parquet``
        (the per-example rows, with the description and summary as JSON in the schema metadata, key ``ffkv``).
        The JSON is strict: a number that is not finite is null, and a summary row without an interval says why
        (``no_interval``)."""
        path = Path(path)
        summary = [{**row, "no_interval": no_interval(row["measure"], row["ci_low"], row["n"])}
                   for row in self.summary.to_dict(orient="records")]
        described = {**self.description(), "summary": summary}
        if path.suffix == ".json":
            atomic.write_json(path, finite_or_null({**described, "examples": self.examples.to_dict(orient="records")}))
        elif path.suffix == ".parquet":
            arrow = pa.Table.from_pandas(self.examples, preserve_index=False)
            text = json.dumps(finite_or_null(described), default=str, allow_nan=False)
            meta = {**(arrow.schema.metadata or {}), b"ffkv": text.encode()}
            atomic.write_parquet(path, arrow.replace_schema_metadata(meta))
        else:
            raise FfkvError(f"--out must end in .json or .parquet, got {path.name!r}")
        return path

    def to_text(self) -> str:
        """The summary as a readable table."""
        edits = ", ".join(f"{edit_ref(e)} {e.op}{'' if e.op == 'off' else ' ' + format(e.value, 'g')}"
                          for e in self.interventions)
        shown = ", ".join(repr(s) for s in self.token_strings[:20]) + (" ..." if len(self.token_strings) > 20 else "")
        lines = [f"interventions (layers from 1): {edits}",
                 f"token set S ({self.token_set_origin}, {len(self.token_set)} tokens): {shown}",
                 f"n = {len(self.examples):,} examples; intervals: {INTERVAL}",
                 *([f"text: {text_measured(self.corpus)}"] if self.corpus else []), ""]
        header = f"{'measure':<28}{'before':>14}{'after':>14}{'change':>14}   95% interval of the change"
        lines.append(header)
        for row in self.summary.itertuples():
            missing = no_interval(row.measure, row.ci_low, row.n)
            interval = f"none: {missing}" if missing else \
                f"[{plain(row.ci_low, sign=True)}, {plain(row.ci_high, sign=True)}]"
            lines.append(f"{row.measure:<28}{plain(row.before):>14}{plain(row.after):>14}"
                         f"{plain(row.change, sign=True):>14}   {interval}")
        return "\n".join(lines)


def no_interval(measure: str, ci_low: float, n: int) -> str | None:
    """Why a summary row has no interval of its change (None when it has one)."""
    if measure == "perplexity":  # exp of the corpus's mean NLL per token: no per-example pairs
        return "a ratio over the whole corpus (see the mean NLL's)"
    if math.isfinite(ci_low):
        return None
    if n < 2:
        return f"n = {n} example{'s' if n != 1 else ''}, fewer than 2"
    return "the per-example changes are not all finite numbers"


def finite_or_null(value: Any) -> Any:
    """`value` (nested dicts and lists) with every number that is not finite as None: strict JSON, which has no
    NaN or Infinity, writes it null."""
    if isinstance(value, (float, np.floating)):
        return float(value) if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite_or_null(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_null(v) for v in value]
    return value


def plain(value: float, digits: int = 4, sign: bool = False) -> str:
    """A number in plain decimals, never in scientific notation: `digits` significant digits (0.000012346,
    not 1.2346e-05; 12,345.7, not 1.2346e+04), a sign when asked for."""
    if value is None or not math.isfinite(value):
        return "n/a"
    if value == 0:
        return "+0" if sign else "0"
    places = max(0, digits - 1 - math.floor(math.log10(abs(value))))
    text = f"{value:{'+' if sign else ''},.{places}f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


def evaluate(loaded: LoadedModel, examples: Sequence[np.ndarray], interventions: Sequence[Intervention],
             token_set: Sequence[int] | None = None, example_ids: Sequence[int] | None = None,
             progress: bool = False, corpus: dict | None = None) -> InterventionResult:
    """The change an intervention makes on examples (token id arrays): perplexity and p(S), paired per example.

    Args:
        interventions: memories rewritten at every position (layers from 0).
        token_set: S as token ids; None: the intervened memories' own top tokens (`own_top_tokens`).
    """
    edits = list(interventions)
    if not edits:
        raise FfkvError("no intervention given")
    origin = "given" if token_set is not None else f"the intervened memories' own top {DEFAULT_TOP} tokens"
    S = sorted(set(int(t) for t in token_set)) if token_set is not None else own_top_tokens(loaded, edits)
    before = score_examples(loaded, examples, token_set=S, progress=progress, desc="baseline")
    after = score_examples(loaded, examples, token_set=S, interventions=edits, progress=progress, desc="intervened")
    return _result(loaded, before, after, edits, S, origin, example_ids, corpus or {})


def _result(loaded, before: Scores, after: Scores, edits, S, origin, example_ids, corpus) -> InterventionResult:
    n = len(before.nll)
    ids = np.arange(n) if example_ids is None else np.asarray(example_ids, dtype=np.int64)
    rows = []
    d_nll = paired_mean_interval(after.nll - before.nll)
    rows.append({"measure": "perplexity", "before": perplexity(before), "after": perplexity(after),
                 "change": perplexity(after) - perplexity(before), "ci_low": float("nan"), "ci_high": float("nan"),
                 "n": n})
    rows.append({"measure": "mean NLL per example (nats)", "before": float(before.nll.mean()),
                 "after": float(after.nll.mean()), "change": d_nll[0], "ci_low": d_nll[1], "ci_high": d_nll[2],
                 "n": n})
    d_mass = paired_mean_interval(after.mass - before.mass)
    rows.append({"measure": "token-set mass p(S)", "before": float(before.mass.mean()),
                 "after": float(after.mass.mean()), "change": d_mass[0], "ci_low": d_mass[1], "ci_high": d_mass[2],
                 "n": n})
    examples = pd.DataFrame({"example_id": ids, "n_predicted": before.n_predicted, "nll_before": before.nll,
                             "nll_after": after.nll, "mass_before": before.mass, "mass_after": after.mass})
    return InterventionResult(pd.DataFrame(rows), examples, list(edits), list(S),
                              list(loaded.tokenizer.token_strings(list(S))), origin, corpus)


def evaluate_corpus(loaded: LoadedModel, spec: CorpusSpec, interventions: Sequence[Intervention],
                    token_set: Sequence[int] | None = None, progress: bool = False) -> InterventionResult:
    """`evaluate` on a corpus's examples (those with at least two tokens)."""
    examples = [e for e in iter_examples(spec, loaded.tokenizer) if len(e.token_ids) >= 2]
    if not examples:
        raise FfkvError(f"no examples with two or more tokens in {spec.source} (split {spec.split!r})")
    return evaluate(loaded, [np.asarray(e.token_ids, np.int64) for e in examples], interventions, token_set,
                    [e.example_id for e in examples], progress, spec.to_dict())
