"""What every experiment shares: the run and its model, projections, held-out examples, tables.

`RunContext` opens a complete run directory once (manifest, model, trigger examples,
example token ids) and is handed to each experiment's ``compute(ctx, options)``. `analyze`
writes the tables that returns (`RunContext.write_table`) to ``RUN/metrics/NAME.parquet``
(`ffkv.store.run.RunDir.write_metric`) with a JSON description (projection, options) in the
Parquet schema metadata, so each table says how it was computed.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Hashable, Sequence, TypeVar

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from ffkv.batching import RowBatches, row_batches
from ffkv.corpus import CorpusSpec, iter_examples
from ffkv.errors import FfkvError, FfkvWarning, said, warn
from ffkv.memories.projection import DEFAULT_FOR_RESIDUALS, DEFAULT_FOR_VALUES, TOP_TOKENS, check_projection, scan_values
from ffkv.memories.targets import trigger_targets
from ffkv.models.default_corpus import true_heldout
from ffkv.models.loading import LoadedModel
from ffkv.parallel import is_writer
from ffkv.presentation.findings import MIN_VERDICT_N, MORE_EXAMPLES, MORE_EXAMPLES_LIBRARY, wilson_interval
from ffkv.presentation.intervals import paired_mean_interval
from ffkv.store.manifest import Manifest
from ffkv.store.run import RunDir
from ffkv.store.schemas import Direction

T = TypeVar("T")


#: Values of `analyze(projection=...)` / `ffkv analyze --projection`.
PROJECTION_CHOICES = ("default", "paper", "identity", "final-norm")
#: The choice whose residual-stream projection each projection is: the paper's released code projects
#: the raw residual (identity), ffkv's default the final normalization (the logit lens).
RESIDUAL_CHOICE = {"identity": "paper", "final-norm": "default"}


@dataclass(frozen=True)
class Projections:
    """Which normalization N each kind of vector goes through before Eᵀ (docs/definitions.md).

    Attributes:
        values: value vectors, memory sub-updates m_i·v_i and the FF output of Figure 8.
        residuals: residual-stream vectors, and every vector of Figures 9-11 (r, f and y of Figure 11
            all go through it: one projection per figure).
        name: the choice that made them: "default", "paper", "identity" or "final-norm".
    """

    values: str = DEFAULT_FOR_VALUES
    residuals: str = DEFAULT_FOR_RESIDUALS
    name: str = "default"

    @classmethod
    def choose(cls, projection: str | None) -> "Projections":
        """ffkv's defaults (docs/definitions.md) for None or "default"; "paper" for the released code's choices (identity for every
        vector: values, sub-updates and the raw residual, no final normalization); "identity" or
        "final-norm" forces that projection on every vector."""
        if projection is None or projection == "default":
            return cls()
        if projection == "paper":
            return cls("identity", "identity", "paper")
        if projection not in PROJECTION_CHOICES:
            raise FfkvError(f"unknown projection {projection!r}; choose from {', '.join(PROJECTION_CHOICES)}")
        check_projection(projection)
        return cls(projection, projection, projection)

    def to_dict(self) -> dict[str, str]:
        return {"choice": self.name, "values_and_sub_updates": self.values, "residuals": self.residuals}


#: Below this many examples (or keys) a per-layer share is too uncertain to read alone: `analyze` warns, the
#: report marks the section, and the fidelity table gives no verdict (`ffkv.presentation.findings.MIN_VERDICT_N`).
MIN_N = MIN_VERDICT_N


def share_with_interval(hits: np.ndarray, name: str) -> dict[str, float]:
    """{name: share, name_ci_low, name_ci_high} of a boolean array (its n is the table's n column)."""
    hits = np.asarray(hits, dtype=bool)
    n, k = len(hits), int(hits.sum())
    low, high = wilson_interval(k, n)
    return {name: float(k / n) if n else float("nan"), f"{name}_ci_low": float(low), f"{name}_ci_high": float(high)}


def chance_with_interval(observed: np.ndarray, chance: np.ndarray, name: str,
                         counted: np.ndarray | None = None) -> dict[str, float]:
    """A permutation chance level beside an observed share, on the same examples (docs/definitions.md, Controls).

    Args:
        observed, chance: per example, the observed event and the same event with the pairing shuffled across
            examples (both boolean, or numbers for a mean).
        counted: the examples whose chance value counts (an example with no partner does not); default all.

    Returns:
        {name_chance, name_chance_ci_low, name_chance_ci_high} (Wilson for a share, mean +- 1.96 standard errors
        for numbers) and {name_minus_chance, _ci_low, _ci_high}: the mean paired difference observed - chance
        over the counted examples with mean +- 1.96 standard errors (NaN below 2 examples).
    """
    counted = np.ones(len(observed), dtype=bool) if counted is None else np.asarray(counted, dtype=bool)
    a, b = np.asarray(observed)[counted], np.asarray(chance)[counted]
    out: dict[str, float] = {}
    if b.dtype == bool:
        out.update({k.replace(name, f"{name}_chance", 1): v for k, v in share_with_interval(b, name).items()})
    else:
        mean, low, high = paired_mean_interval(b)
        out.update({f"{name}_chance": mean, f"{name}_chance_ci_low": low, f"{name}_chance_ci_high": high})
    mean, low, high = paired_mean_interval(a.astype(np.float64) - b.astype(np.float64))
    out.update({f"{name}_minus_chance": mean, f"{name}_minus_chance_ci_low": low, f"{name}_minus_chance_ci_high": high})
    return out


def control_with_interval(observed: np.ndarray, control: np.ndarray, name: str) -> dict[str, float]:
    """A share of the model's keys beside the same share of the random control memories (independent samples).

    Returns {name_control, _ci_low, _ci_high} (Wilson) and {name_minus_control, _ci_low, _ci_high}: the difference
    with Newcombe's hybrid score interval (his method 10, from the two Wilson intervals), NaN where either is empty.
    """
    observed, control = np.asarray(observed, dtype=bool), np.asarray(control, dtype=bool)
    p1, l1, u1 = (share_with_interval(observed, "x")[k] for k in ("x", "x_ci_low", "x_ci_high"))
    got = share_with_interval(control, f"{name}_control")
    p2, l2, u2 = got[f"{name}_control"], got[f"{name}_control_ci_low"], got[f"{name}_control_ci_high"]
    d = p1 - p2
    low = d - float(np.sqrt((p1 - l1) ** 2 + (u2 - p2) ** 2))
    high = d + float(np.sqrt((u1 - p1) ** 2 + (p2 - l2) ** 2))
    return {**got, f"{name}_minus_control": d, f"{name}_minus_control_ci_low": low,
            f"{name}_minus_control_ci_high": high}


def beside_neurons(latents: np.ndarray, neurons: np.ndarray, name: str) -> dict[str, float]:
    """A share of a layer's latents beside the same share of its neurons (independent samples): `control_with_interval`
    with the neurons in the control's place, {name_neurons, _ci_low, _ci_high} (Wilson) and {name_minus_neurons,
    _ci_low, _ci_high} (Newcombe's interval of latents minus neurons)."""
    return {k.replace("_control", "_neurons"): v for k, v in control_with_interval(latents, neurons, name).items()}


def excess_beside_neurons(latents: np.ndarray, latent_control: np.ndarray, neurons: np.ndarray,
                          neuron_control: np.ndarray, name: str) -> dict[str, float]:
    """A share of a layer's latents and of its neurons, each beside its own random-direction control: per kind,
    {name_KIND, _ci_low, _ci_high} (Wilson), n_KIND, {name_KIND_control, name_KIND_minus_control, _ci_low,
    _ci_high} (Newcombe) and n_control_KIND (KIND: latents, neurons); then the latents' excess over their control
    minus the neurons' over theirs, {excess_name_latents_minus_neurons, _ci_low, _ci_high} (MOVER: the two Newcombe
    intervals combined as Newcombe combines two Wilson intervals), NaN where a control is empty; and
    verdict_name (`excess_verdict`)."""
    row: dict = {}
    for kind, mine, theirs in (("latents", latents, latent_control), ("neurons", neurons, neuron_control)):
        mine, theirs = np.asarray(mine, dtype=bool), np.asarray(theirs, dtype=bool)
        row.update(share_with_interval(mine, f"{name}_{kind}"))
        row[f"n_{name}_{kind}"] = int(len(mine))
        got = control_with_interval(mine, theirs, f"{name}_{kind}") if len(theirs) and len(mine) else {}
        for part in ("control", "minus_control", "minus_control_ci_low", "minus_control_ci_high"):
            row[f"{name}_{kind}_{part}"] = got.get(f"{name}_{kind}_{part}", np.nan)
        row[f"n_{name}_{kind}_control"] = int(len(theirs))
    d1, l1, u1 = (row[f"{name}_latents_minus_control{s}"] for s in ("", "_ci_low", "_ci_high"))
    d2, l2, u2 = (row[f"{name}_neurons_minus_control{s}"] for s in ("", "_ci_low", "_ci_high"))
    d = d1 - d2
    excess = f"excess_{name}_latents_minus_neurons"
    row.update({excess: d, f"{excess}_ci_low": d - float(np.sqrt((d1 - l1) ** 2 + (u2 - d2) ** 2)),
                f"{excess}_ci_high": d + float(np.sqrt((u1 - d1) ** 2 + (d2 - l2) ** 2))})
    fewest = min(row[f"n_{name}_latents"], row[f"n_{name}_neurons"], row[f"n_{name}_latents_control"],
                 row[f"n_{name}_neurons_control"])
    row[f"verdict_{name}"] = excess_verdict(row[f"{excess}_ci_low"], row[f"{excess}_ci_high"], fewest)
    return row


def excess_verdict(low: float, high: float, fewest: int, judged: str = "judged") -> str:
    """Which kind stands higher against its own control, from the 95% interval [low, high] of the latents' excess
    minus the neurons': read only where every kind and control has at least `MIN_N` memories `judged` (`fewest`).
    Said as higher or lower, never as which kind "exceeds" its control: for a share where lower is better (dead
    memories) the latents lower than the neurons, each against its own control, is the latents' good news."""
    if fewest < MIN_N:
        return f"no verdict: {int(fewest)} memories of one kind or control are {judged}, fewer than {MIN_N}"
    if not (np.isfinite(low) and np.isfinite(high)):
        return "no verdict: no control to set it against"
    if low > 0:
        return "latents higher than neurons, each against its own control"
    if high < 0:
        return "latents lower than neurons, each against its own control"
    return "undecided: the interval of the difference holds 0"


def sample_size_warnings(experiment: str, n: int, what: str = "examples") -> list[str]:
    """A one-line warning (also raised as an `FfkvWarning`, printed by the CLI) when n < `MIN_N`; [] otherwise.

    The lines go into the table's description (`warnings`), which the report shows in the section.
    """
    if n >= MIN_N:
        return []
    line = (f"{experiment}: per-layer shares rest on n = {n} {what}, fewer than {MIN_N}; read them with their "
            "95% intervals (in brackets in the report; the *_ci_low and *_ci_high columns of the table); no "
            "finding gets a verdict on so few")
    if what == "examples":  # held-out examples: the user can give more
        line += "; for more, " + said(MORE_EXAMPLES, MORE_EXAMPLES_LIBRARY)
    if is_writer():
        warn(line)
    return [line]


@dataclass(frozen=True)
class HeldOut:
    """The held-out examples of docs/definitions.md, each with one seeded position.

    Attributes:
        examples: the examples (token ids as the corpus gives them).
        positions: (N,) the analysed position of each example; for a causal LM the
            prefix x_1..x_{j+1} predicts the token after it, for an encoder the token at
            the position is masked.
        targets: (N,) the gold token: the next token (causal) or the masked token (encoder).
        spec: the corpus spec they were read with (for the manifest).
    """

    examples: list
    positions: np.ndarray
    targets: np.ndarray
    spec: CorpusSpec

    @property
    def example_ids(self) -> np.ndarray:
        return np.array([e.example_id for e in self.examples], dtype=np.int64)


@dataclass
class RunContext:
    """A complete run opened for analysis, shared by the experiments of one `analyze` call.

    What more than one experiment needs is computed once and kept here (`once`): the
    trigger examples, the example token ids, the held-out examples, the held-out forward
    pass, each layer's value top tokens.
    """

    run: RunDir
    manifest: Manifest
    loaded: LoadedModel
    projections: Projections = field(default_factory=Projections)
    progress: bool = True
    seed: int = 0
    eval_spec: CorpusSpec | None = None
    #: the held-out examples the call asked for (`analyze`'s n_eval): a study that reads a text of its own reads as
    #: many (membership, at most its default per split); None: each study's own default.
    n_eval: int | None = None
    #: experiment name -> its own options (e.g. membership's corpora), from `analyze(options=...)`.
    options: dict = field(default_factory=dict)
    #: where the dictionary the run was indexed with lies now, if its files moved (`ffkv.dictionaries.reopen`);
    #: None: where the run records it.
    dictionary_at: str | Path | None = None
    analyses: dict = field(default_factory=dict)
    #: the experiment running now (`analyze` sets it): the step each table is recorded as written by.
    step: str | None = None
    #: the experiments this call runs (`analyze` sets them, skipped ones left out): the held-out pass is read by
    #: every one of them that declares a reader (`ffkv.experiments.heldout.read_held_out`).
    steps: tuple[str, ...] = ()
    _shared: dict = field(default_factory=dict, repr=False)

    # ----------------------------------------------------------- the model
    @property
    def view(self):
        return self.loaded.view

    @property
    def tokenizer(self):
        return self.loaded.tokenizer

    @property
    def special_ids(self) -> frozenset[int]:
        """Token ids of special tokens (BOS, CLS, SEP, ...)."""
        return self.loaded.special_ids

    @property
    def top_k(self) -> int:
        return self.manifest.top_k

    def once(self, name: Hashable, compute: Callable[[], T]) -> T:
        """`compute()` the first time `name` is asked for in this context, the same object after."""
        if name not in self._shared:
            self._shared[name] = compute()
        return self._shared[name]

    def value_scan(self, layer: int, projection: str, targets: np.ndarray, sign: int = 1, top: int = TOP_TOKENS
                   ) -> dict[str, np.ndarray]:
        """`scan_values` of one layer's values, once in this context for the same projection, targets, sign and top:
        the values experiment's scan of direction +1 is the explorer lookups' (their targets are both the top-1
        trigger targets), so a model's |V|-wide value projections run once per analyze, not twice. The arrays are
        shared: read them, never write them. They stay for the whole call: about 160 bytes per memory, projection
        and sign (73 MB per sign at Llama-3.1-8B's 32 x 14,336 memories), nothing |V|-wide."""
        targets = np.ascontiguousarray(targets, dtype=np.int64)
        name = ("value_scan", int(layer), projection, int(sign), int(top), hashlib.sha256(targets.tobytes()).hexdigest())
        return self.once(name, lambda: scan_values(self.view, layer, projection, targets, top=top, sign=sign))

    def batches(self, rows: Sequence[tuple[int, np.ndarray]]) -> RowBatches:
        """This rank's padded batches of (row index, token ids) rows on the model's device."""
        return row_batches(rows, self.tokenizer.pad_id, self.special_ids, self.view.device)

    # ----------------------------------------------------------- what a step reads of another
    def provenance(self) -> dict[str, Any]:
        """What an experiment's result depends on besides its code: this run's identity (model, weights, corpus,
        index options: a digest), the seed, the held-out examples and the projections. `analyze` records it with
        each experiment (manifest['analyses'][NAME]['provenance']); `need` compares it."""
        identity = json.dumps(self.manifest.identity.to_dict(), sort_keys=True, default=str)
        return {"identity": hashlib.sha256(identity.encode()).hexdigest(), "seed": self.seed,
                "eval_corpus": self.eval_spec.to_dict() if self.eval_spec is not None else None,
                "projections": self.projections.to_dict()}

    def need(self, experiment: str, table: str | None = None, optional: bool = False) -> pd.DataFrame | None:
        """metrics/TABLE.parquet (default: the experiment's own table) of another experiment, only where it was
        computed on this run's identity, seed, held-out examples and projections: in this `analyze` call, or by
        an earlier one whose record says so (`provenance`). Otherwise refused with one line naming the command
        that computes it. `optional`: None where the run holds no result of it (never computed, skipped, or its
        table absent); a result computed on something else (`stale`) is refused all the same, since reading
        around it would leave its rows out without a word."""
        table = table or experiment
        stale = self.stale(experiment)
        why = stale or self.absence(experiment)
        if why is None and not self.run.has_metric(table):
            why = f"{self.run.metric_path(table)} is missing"
        if why is None:
            return self.run.read_metric(table)
        if optional and stale is None:
            return None
        raise FfkvError(f"{self.step or 'this step'} needs {experiment}: {why}; run "
                        f"`ffkv analyze {self.run.path} --only {experiment},{self.step or experiment}`")

    def provenance_mismatch(self, experiment: str) -> str | None:
        """Why the run's results of `experiment` are not this call's to read (None when they are): it holds none
        (`absence`), or they were computed on something else (`stale`)."""
        return self.absence(experiment) or self.stale(experiment)

    def absence(self, experiment: str) -> str | None:
        """Why the run holds no result of `experiment` for this call: skipped in it, or never computed (or skipped)
        by an earlier one; None when it holds one (this call's, or an earlier one's, `stale` or not)."""
        if experiment in self.analyses:  # this call
            return f"it was skipped ({self.analyses[experiment]['skipped']})" if "skipped" in self.analyses[
                experiment] else None
        record = self.run.manifest().analyses.get(experiment)
        return "the run holds no result of it" if not record or "skipped" in record else None

    def stale(self, experiment: str) -> str | None:
        """Why the run's result of `experiment`, written by an earlier analyze, was computed on another identity,
        seed, held-out examples or projections than this call's; None when it was not, or when the run holds no
        result of it (never computed, skipped) or this call computed it."""
        from ffkv.experiments.registry import get

        if experiment in self.analyses:
            return None
        record = self.run.manifest().analyses.get(experiment)
        if not record or "skipped" in record:
            return None
        then, now = record.get("provenance"), self.provenance()
        if then is None:
            return "it was computed by an analyze that did not record on what (seed, held-out examples)"
        if not get(experiment).held_out:
            then, now = {**then, "eval_corpus": None}, {**now, "eval_corpus": None}
        differ = [k for k in now if then.get(k) != now[k]]
        return (f"it was computed on another {' and '.join(k.replace('_', ' ') for k in differ)} than this call's"
                if differ else None)

    # ----------------------------------------------------------- run tables
    def triggers(self, direction: "Direction | int" = Direction.POSITIVE, control: bool = False,
                 source: str = "neurons") -> pd.DataFrame:
        """The trigger examples of one direction (`RunDir.read_triggers`), sorted by (layer, key, rank): +1
        (the largest coefficients, the paper's) by default, -1 for the most negative ones; -1 is empty for a
        run indexed with one direction. A study that reads triggers sees one direction at a time, never the
        two mixed. `control`: those of the random control memories (`has_control`) instead. `source`
        ``latents``: those of the dictionary's latents (`has_latents`; positive only)."""
        direction = Direction.parse(direction)

        def read() -> pd.DataFrame:
            one_sign = self.manifest.sign != "both" or source == "latents"
            if direction == Direction.NEGATIVE and one_sign:
                return self.run.read_triggers(Direction.POSITIVE, control=control,
                                              source=source).iloc[0:0].reset_index(drop=True)
            df = self.run.read_triggers(direction, control=control, source=source)
            return df.sort_values(["layer", "key", "rank"], kind="stable").reset_index(drop=True)
        return self.once(("triggers", int(direction), control, source), read)

    @property
    def has_latents(self) -> bool:
        """Whether the run indexed a sparse dictionary's latents (`ffkv index --dictionary`)."""
        return bool(self.manifest.index.get("dictionary")) and self.run.table("latent_trigger_examples").is_file()

    def memories(self, source: str = "neurons"):
        """The run's memories of one source (`ffkv.memories.sets`): the model's ``neurons``, or the ``latents`` of
        the dictionary the run was indexed with, read again from its files (`ffkv.dictionaries.reopen`: refused,
        naming the file, where they are gone or changed)."""
        from ffkv.memories.sets import Latents, Neurons

        if source == "neurons":
            return Neurons(self.view)
        return self.once(("memories", source),
                         lambda: Latents.of_run(self.view, self.manifest.index.get("dictionary"), self.dictionary_at,
                                                self.run.path))

    def dictionary_problem(self) -> str | None:
        """Why the dictionary the run was indexed with cannot be read again (its files gone or changed:
        `memories`), or None: it can, or the run has none. A step that reads nothing but latents is skipped by it."""
        if not self.has_latents:
            return None
        try:
            self.memories("latents")
        except FfkvError as error:
            return f"the run's dictionary cannot be read: {error}"
        return None

    def latents_for(self, table: str):
        """The run's latents (`memories`) for a study's latent `table`, as (latents, []); (None, []) for a run
        without them; and (None, [line]) where the dictionary's files are gone or changed: the study's neuron
        tables stand, and `line` (also raised as an `FfkvWarning`) says why `table` was not computed."""
        if not self.has_latents:
            return None, []
        try:
            return self.memories("latents"), []
        except FfkvError as error:
            line = f"{table} not computed: {error}"
            if is_writer():
                warn(line)
            return None, [line]

    def latent_keys(self):
        """The run's dictionary as the index read it (`ffkv.memories.latent_keys.LatentKeys`: the same activations and
        the same control latents, redrawn from the run's control seed and checked against
        latent_control_keys.parquet), once. Refused in one line for a run without latents, or one whose dictionary
        is gone or changed (`memories`)."""
        from ffkv.memories.latent_keys import LatentKeys

        def build() -> LatentKeys:
            if not self.has_latents:
                raise FfkvError(f"{self.run.path} was indexed without a dictionary: it has no latents (index it again "
                                "with `ffkv index --dictionary PATH`)")
            latents = self.memories("latents")
            n_control = self.manifest.control_keys if self.has_latent_control else 0
            found = LatentKeys(latents.dictionaries, n_control, self.manifest.identity.index.get("control_seed", 0),
                               self.view.device)
            if n_control:
                recorded = self.latent_control_sources()
                for layer in found.layers:
                    if not np.array_equal(as_numpy(found.source(layer)), recorded.get(layer, np.zeros(0))):
                        raise FfkvError(f"the control latents of layer {layer + 1} drawn again differ from those of "
                                        f"{self.run.table('latent_control_keys')}; index the run again")
            return found
        return self.once("latent_keys", build)

    def latent_control_sources(self) -> dict[int, np.ndarray]:
        """Dictionary layer -> (n,) the real latent whose encoder norm, bias and value each control latent of that
        layer borrows (latent_control_keys.parquet)."""
        def read() -> dict[int, np.ndarray]:
            name = self.run.table("latent_control_keys").name
            self.run.require_table(name)
            table = pd.read_parquet(self.run.table("latent_control_keys")).sort_values(["layer", "key"])
            return {int(layer): g["source_key"].to_numpy(np.int64) for layer, g in table.groupby("layer")}
        return self.once("latent_control_sources", read)

    @property
    def has_latent_control(self) -> bool:
        """Whether the run holds control latents beside its latents."""
        return self.has_latents and self.run.table("latent_control_trigger_examples").is_file() \
            and self.manifest.control_keys > 0

    @property
    def has_control(self) -> bool:
        """Whether the run holds a random-key control (`ffkv.memories.controls`, `ffkv index --control-keys`)."""
        return self.manifest.control_keys > 0 and self.run.table("control_trigger_examples").is_file()

    def control_sources(self) -> np.ndarray:
        """(L, n) the real key whose norms, biases and value each control memory borrows (control_keys.parquet)."""
        def read() -> np.ndarray:
            self.run.require_table(self.run.table("control_keys").name)
            table = pd.read_parquet(self.run.table("control_keys"))
            out = np.zeros((self.view.n_layers, self.manifest.control_keys), dtype=np.int64)
            out[table["layer"].to_numpy(int), table["key"].to_numpy(int)] = table["source_key"].to_numpy()
            return out
        return self.once("control_sources", read)

    def examples(self) -> dict[int, tuple[np.ndarray, str]]:
        """example_id -> (token ids, text) of every example that is some key's (or control memory's) trigger."""
        def read() -> dict[int, tuple[np.ndarray, str]]:
            ids = self.run.read_triggers("both")["example_id"].to_numpy()
            if self.has_control:
                ids = np.concatenate([ids, self.run.read_triggers("both", control=True)["example_id"].to_numpy()])
            if self.has_latents:
                ids = np.concatenate([ids, *(self.run.read_triggers(control=c, source="latents")["example_id"]
                                             .to_numpy() for c in (False, True)[:1 + self.has_latent_control])])
            wanted = pa.array(np.unique(ids), pa.int64())
            table = pq.read_table(self.run.table("examples"), filters=[("example_id", "in", wanted)]) \
                if len(wanted) else pq.read_table(self.run.table("examples")).slice(0, 0)
            ids = table.column("example_id").to_numpy()
            tokens = table.column("token_ids").to_pylist()
            texts = table.column("text").to_pylist()
            return {int(i): (np.asarray(t, dtype=np.int64), s) for i, t, s in zip(ids, tokens, texts)}
        return self.once("examples", read)

    def prefix(self, example_id: int, position: int) -> np.ndarray:
        """Token ids x_1..x_{position+1} of a stored example."""
        return self.examples()[int(example_id)][0][: int(position) + 1]

    def trigger_targets(self, direction: int = 1, control: bool = False, source: str = "neurons") -> pd.DataFrame:
        """The trigger examples of one direction with a ``target`` column: the token the key's value should
        predict (`ffkv.memories.targets`: the next token, or the token at the position for an encoder)."""
        def compute() -> pd.DataFrame:
            trig = self.triggers(direction, control, source)
            at_position = [int(self.prefix(e, p)[-1]) for e, p in zip(trig["example_id"], trig["position"])] \
                if self.view.encoder else trig["next_token_id"].to_numpy()
            return trig.assign(target=trigger_targets(trig["next_token_id"].to_numpy(), np.asarray(at_position),
                                                      self.view.encoder))
        return self.once(("trigger_targets", direction, control, source), compute)

    def token(self, token_id: int) -> str:
        """Readable string of one token id; the end marker for -1."""
        if token_id is None or int(token_id) < 0:
            return "⟨end⟩"
        try:
            return self.tokenizer.token_strings([int(token_id)])[0]
        except Exception:  # noqa: BLE001 - ids past the tokenizer's own vocabulary (padded heads)
            return f"<{int(token_id)}>"

    def tokens(self, ids: Sequence[int]) -> list[str]:
        return [self.token(i) for i in ids]

    def prefix_text(self, example_id: int, position: int) -> str:
        """Readable text of a stored prefix (decoded; special tokens kept as the tokenizer shows them)."""
        try:
            return self.tokenizer.decode([int(t) for t in self.prefix(example_id, position)])
        except Exception:  # noqa: BLE001
            return "".join(self.tokens(self.prefix(example_id, position)))

    # --------------------------------------------------------------- output
    def write_table(self, name: str, df: pd.DataFrame, **meta: Any) -> Path:
        """Write RUN/metrics/NAME.parquet atomically, with how it was computed in its metadata (`analyze` writes an
        experiment's `Result` with it: experiments return their tables, they do not write them).

        Under torchrun only rank 0 writes; every rank gets the path.
        """
        if not is_writer():
            return self.run.metric_path(name)
        return self.run.write_metric(name, df, {"model_id": self.loaded.model_id, **meta}, step=self.step)

    def record(self, experiment: str, **info: Any) -> None:
        """Note what an experiment wrote and how (merged into the manifest's analyses at the end; `analyze` records
        each experiment's `Result` with it)."""
        self.analyses[experiment] = info

    # -------------------------------------------------------------- held out
    def held_out(self) -> HeldOut:
        """The held-out examples with their seeded positions (read once per `analyze`)."""
        if self.eval_spec is None:
            raise FfkvError("no held-out examples were given to this analysis")
        return self.once("held_out", lambda: select_held_out(self.loaded, self.eval_spec, self.seed))


def open_run(run_dir: str | Path, loaded: LoadedModel | None = None, device: str = "cpu",
             dtype: str | None = None) -> tuple[RunDir, Manifest, LoadedModel]:
    """A complete run, its manifest, and its model (loaded from the manifest unless given)."""
    run = RunDir(run_dir)
    manifest = run.require_complete()
    if loaded is None:
        from ffkv.models import load_model

        loaded = load_model(manifest.model.id, dtype=dtype or manifest.model.dtype, device=device)
        if loaded.weights_hash() != manifest.identity.weights_sha256:
            warn(f"the weights of {manifest.model.id!r} differ from those the run was indexed with; "
                 "trigger examples may not match this model")
    if (manifest.model.n_layers, manifest.model.d_m) != (loaded.view.n_layers, loaded.view.d_m):
        raise FfkvError(f"the model ({loaded.view.n_layers} layers x {loaded.view.d_m} memories) does not match "
                        f"the run ({manifest.model.n_layers} x {manifest.model.d_m}); analyse the run with its "
                        "own model")
    return run, manifest, loaded


def eval_spec(manifest: Manifest, corpus: str | Path | CorpusSpec | dict | None = None, split: str | None = None,
              n_eval: int = 4000, seed: int = 0) -> CorpusSpec:
    """The held-out examples' corpus spec (docs/definitions.md), for the CLI and the library alike.

    Args:
        corpus: None for the run's own corpus (split "heldout" unless `split` says otherwise), or, where that
            corpus is the model's own training text (`ffkv.models.default_corpus.true_heldout`: ffkv-tiny's), the
            text the model was never trained on;
            a path, read with the run's unit and length options (split "all" unless given);
            or a `CorpusSpec` (or its dict), used as it is (but for `split`, when given).
        n_eval: the spec is cut to a seeded uniform subset of this many examples (4,000 by default).
        seed: the subset's seed, unless the spec has a shuffle seed of its own.
    """
    if not isinstance(n_eval, int) or isinstance(n_eval, bool) or n_eval < 1:
        raise FfkvError(f"--n-eval must be a positive integer, got {n_eval!r}")
    base = manifest.corpus or manifest.identity.corpus
    held = true_heldout(manifest.model.id, base.get("source", "")) if corpus is None else None
    if held is not None and split in (None, "heldout"):
        # The run's corpus is the model's training text: its hash split would be training text too.
        spec = replace(CorpusSpec.from_dict(base), source=str(held), split="all")
    elif corpus is None:
        spec = replace(CorpusSpec.from_dict(base), split=split or "heldout")
    elif isinstance(corpus, (CorpusSpec, dict)):
        spec = CorpusSpec.from_dict(corpus) if isinstance(corpus, dict) else corpus
        spec = replace(spec, split=split) if split else spec
    else:
        keep = {k: base[k] for k in ("unit", "window", "max_tokens", "min_tokens", "text_field") if k in base}
        spec = CorpusSpec(source=str(corpus), split=split or "all", **keep)
    shuffle = spec.shuffle_seed if spec.shuffle_seed is not None else seed
    return replace(spec, max_examples=n_eval, shuffle_seed=shuffle)


def text_measured(spec: CorpusSpec | dict) -> str:
    """Which text a measurement read, as every command prints it: the file, its split and how many examples."""
    spec = CorpusSpec.from_dict(spec) if isinstance(spec, dict) else spec
    split = "" if spec.split == "all" else f", its {spec.split!r} split (a hash split of its examples)"
    most = f", a seeded subset of at most {spec.max_examples:,} examples" if spec.max_examples else ""
    return f"{spec.source}{split}{most}"


def mask_token_id(tokenizer) -> int | None:
    """The [MASK] id of an encoder's tokenizer, if it has one."""
    for owner in (tokenizer, getattr(tokenizer, "hf", None)):
        for name in ("mask_id", "mask_token_id"):
            value = getattr(owner, name, None)
            if isinstance(value, int):
                return value
    return None


def choose_position(token_ids: np.ndarray, special: frozenset, seed: int, example_id: int, encoder: bool) -> int | None:
    """One position per example, seeded by (seed, example id) alone, so it never depends on the others.

    Causal LM: a non-special position with a next token (the prediction can be checked);
    encoder: any non-special position (it will be masked). None when there is none.
    """
    n = len(token_ids)
    ok = np.array([int(t) not in special for t in token_ids], dtype=bool)
    if not encoder:
        ok[n - 1:] = False
    candidates = np.flatnonzero(ok)
    if not len(candidates):
        return None
    rng = np.random.default_rng([seed, int(example_id)])
    return int(candidates[rng.integers(len(candidates))])


def select_held_out(loaded: LoadedModel, spec: CorpusSpec, seed: int = 0) -> HeldOut:
    """Read the held-out examples and draw one position in each (examples with none are skipped)."""
    special = loaded.special_ids
    encoder = loaded.view.encoder
    kept, positions, targets = [], [], []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FfkvWarning)  # an empty split is reported below, as an error
        for e in iter_examples(spec, loaded.tokenizer):
            ids = np.asarray(e.token_ids, dtype=np.int64)
            j = choose_position(ids, special, seed, e.example_id, encoder)
            if j is None:
                continue
            kept.append(e)
            positions.append(j)
            targets.append(int(ids[j]) if encoder else int(ids[j + 1]))
    if not kept:
        raise FfkvError(f"no held-out examples with a position to analyse in {spec.source} "
                        f"(split {spec.split!r}); give another --eval-corpus or --eval-split")
    return HeldOut(kept, np.array(positions, dtype=np.int64), np.array(targets, dtype=np.int64), spec)


def progress_bar(show: bool, total: int, desc: str, unit: str = "it"):
    """A progress bar, shown by the writing rank only (one bar for a torchrun job)."""
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit=unit, disable=not (show and is_writer()), dynamic_ncols=True,
                leave=False)


def check_only(only, names: Sequence[str]) -> list[str]:
    """Validate an --only list (names or a comma-separated string) against the experiments."""
    if only is None:
        return list(names)
    if isinstance(only, str):
        only = [s.strip() for s in only.split(",") if s.strip()]
    unknown = [n for n in only if n not in names]
    flag = said("--only", "only=")
    if unknown:
        close = difflib.get_close_matches(unknown[0], names, n=1, cutoff=0.6)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise FfkvError(f"unknown experiment {unknown[0]!r} in {flag}; {hint}choose from {', '.join(names)}")
    if not only:
        raise FfkvError(f"{flag} names no experiment; choose from {', '.join(names)}")
    return [n for n in names if n in only]


def as_numpy(t: torch.Tensor) -> np.ndarray:
    return t.detach().to("cpu").numpy()
