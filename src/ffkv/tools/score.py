"""`ffkv score RUN`: how well each explanation predicts its memory, by simulation (Bills et al. 2023).

A simulator (a language model, `ffkv.tools.llm_backends`) sees only an explanation and a text, and predicts the
memory's activation (0-10) at every token; the score is the Pearson correlation between its predictions and
the true activations d·m_i (`ffkv.tools.activations`), pooled over the held-out texts. The texts are ones the
explainer never saw, a stated mix:

- `TOP_EXAMPLES` of the memory's own top trigger examples of that direction, the odd ranks 1, 3, 5, ...
  (`ffkv.tools.explain.held_out_ranks`; the explainer saw the even ranks), each the same window of tokens
  around its trigger position as the explainer's;
- `RANDOM_EXAMPLES` random windows of random examples of the run's corpus, drawn per layer (seeded), the same
  for every memory of the layer, leaving out any the memory's explainer was shown.

A simulator that predicts the same value at every token explains nothing and scores 0; a memory whose true
activations are the same at every token has no score (NaN, left out of the means).

Two baselines, in the same run: every memory scored with the explanation of *another* memory of its layer and
direction (a seeded shuffle), and the random control memories (`ffkv explain --controls`) scored with their own
explanations. Written: RUN/metrics/explanation_scores.parquet (one row per explanation and baseline) and
RUN/metrics/explanation_scores_by_layer.parquet (per layer, the neurons' mean score with its 95% interval beside
both baselines). Simulations are kept as they arrive (RUN/journal/explanation_simulations.parquet, keyed by the
prompt's hash), so a resumed `score` sends only what is missing.

A dictionary's latents explained (`ffkv explain --latents`, kinds "latent" and "latent_control") are scored the same
way, against their true activations a_j (`ffkv.tools.activations.token_latent_activations`), on the same random
windows as the neurons of their layer; their shuffled baseline shuffles among the latents, their control is the
control latents. RUN/metrics/explanation_scores_latents.parquet sets them beside the neurons per dictionary
layer (`latents_by_layer`); the neurons' tables are computed from the neurons' rows alone, so they are the same
with or without latents.
"""

from __future__ import annotations

import sys
from typing import Callable, Sequence

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ffkv.errors import FfkvError
from ffkv.experiments.common import RunContext, open_run
from ffkv.experiments.explanations import (BY_LAYER, CONTROL_OF, LATENT_KINDS, LATENTS, NEURON_KINDS, ONE_PER,
                                           SCORES, read_explanation_rows)
from ffkv.presentation.intervals import mean_difference_interval, paired_mean_interval
from ffkv.tools.explain import (TABLE, WINDOW, Target, coefficients_of, held_out_ranks, piece, prompt_hash,
                                run_requests, shown_ranks, trigger_rows, window)
from ffkv.tools.journal import KEY, Journal
from ffkv.tools.llm_backends import Backend, Message

SIMULATIONS = "explanation_simulations"
#: Held-out texts per explanation: top-activating (odd trigger ranks) and random.
TOP_EXAMPLES = 5
RANDOM_EXAMPLES = 5

SYSTEM = ("You predict how strongly a memory of a language model activates on each token of a text, knowing only "
          "an explanation of what the memory responds to.")


def simulation_messages(explanation: str, pieces: Sequence[str]) -> list[Message]:
    """The simulator's chat: the explanation and the text one numbered token a line; its reply is one line per
    token, ``i<TAB>digit`` (`ffkv.tools.llm_backends.reply_line`)."""
    lines = [f"Explanation of the memory: {explanation}", "", "Tokens of the text, one per line (number, tab, token):"]
    lines += [f"{i}\t{p}" for i, p in enumerate(pieces, 1)]
    lines += ["", "For every token, write its number, a tab and the memory's activation on it from 0 (none) to 10 "
              "(strongest), one token per line, nothing else."]
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "\n".join(lines)}]


def correlation(predicted: np.ndarray, true: np.ndarray) -> float:
    """Pearson's r; 0 for a constant prediction, NaN for constant true activations."""
    predicted, true = np.asarray(predicted, float), np.asarray(true, float)
    if len(true) < 2 or np.ptp(true) == 0:
        return float("nan")
    if np.ptp(predicted) == 0:
        return 0.0
    return float(np.corrcoef(predicted, true)[0, 1])


def random_windows(ctx: RunContext, layer: int, n: int, seed: int) -> list[tuple[int, int, int]]:
    """(example id, start, end) of `n` random windows of random examples of the run's corpus, seeded by
    (seed, layer)."""
    if n <= 0:
        return []
    table = pq.read_table(ctx.run.table("examples"), columns=["example_id", "token_ids"])
    ids = table.column("example_id").to_numpy()
    lengths = pc.list_value_length(table.column("token_ids")).to_numpy()
    rng = np.random.default_rng([seed, layer, 2])
    out = []
    for row in rng.permutation(len(ids))[:n]:
        length = int(lengths[row])
        end = int(rng.integers(min(length, WINDOW), length + 1)) if length else 0
        out.append((int(ids[row]), max(0, end - WINDOW), end))
    return out


def _token_ids(ctx: RunContext, example_ids: Sequence[int]) -> dict[int, np.ndarray]:
    known = ctx.examples()
    missing = sorted({int(e) for e in example_ids} - set(known))
    if missing:
        table = pq.read_table(ctx.run.table("examples"), columns=["example_id", "token_ids"],
                              filters=[("example_id", "in", pa.array(missing, pa.int64()))])
        known = {**known, **{int(i): (np.asarray(t, np.int64), "") for i, t in
                             zip(table.column("example_id").to_numpy(), table.column("token_ids").to_pylist())}}
    return {int(e): known[int(e)][0] for e in example_ids}


def shuffled_sources(rows: pd.DataFrame, seed: int) -> np.ndarray:
    """For each explanation row of a real memory (or latent), the row whose explanation it is scored with in the
    shuffled baseline: another memory of the same kind, layer, direction and explainer (a seeded cyclic shift of a
    seeded order, so never itself); -1 where the group has one memory."""
    out = np.full(len(rows), -1)
    for salt, kind in enumerate(CONTROL_OF):  # the neurons' draws are as they were before latents had any
        real = rows["kind"].to_numpy() == kind
        for g, index in rows[real].groupby(["layer", "direction", "explainer"]).indices.items():
            members = np.flatnonzero(real)[index]
            if len(members) < 2:
                continue
            rng = np.random.default_rng([seed, int(g[0]), int(g[1] > 0), *([salt] if salt else [])])
            order = members[rng.permutation(len(members))]
            out[order] = np.roll(order, 1)
    return out


def score(run, simulator: Backend, *, top_examples: int = TOP_EXAMPLES, random_examples: int = RANDOM_EXAMPLES,
          seed: int = 0, layers: Sequence[int] | None = None, loaded=None, progress: bool = True,
          say: Callable[[str], None] | None = None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Score every stored explanation (module docstring); (the per-explanation table, the per-layer table).

    Args:
        layers: score only these layers (0-based; default every layer with explanations).
    """
    say = say or (lambda line: print(line, file=sys.stderr))
    run_dir, manifest, loaded = open_run(run, loaded)
    ctx = RunContext(run_dir, manifest, loaded, progress=progress, seed=seed)
    if not run_dir.has_metric(TABLE):
        raise FfkvError(f"{run_dir.path} has no explanations; run `ffkv explain {run_dir.path}` first")
    explained = read_explanation_rows(run_dir, columns=["explanation"])
    rows = explained if layers is None else explained[explained["layer"].isin(list(layers))]
    rows = rows.reset_index(drop=True)
    if not len(rows):
        raise FfkvError("no explanations to score in the layers asked for; run `ffkv explain` on them first")
    targets = [Target(str(r.kind), int(r.layer), int(r.key), int(r.direction)) for r in rows.itertuples()]
    shuffled = shuffled_sources(rows, seed)
    with run_dir.lock("score"):
        # The held-out texts of every target: its odd-rank trigger windows, then its layer's random windows.
        randoms = {layer: random_windows(ctx, layer, random_examples, seed) for layer in sorted(rows["layer"].unique())}
        texts: dict[Target, list[tuple[int, int, int]]] = {}
        ranks_shown, ranks_held = shown_ranks(ctx.top_k), held_out_ranks(ctx.top_k, top_examples)
        for t in targets:
            seen = set(int(e) for e in trigger_rows(ctx, t, ranks_shown)["example_id"])
            held = trigger_rows(ctx, t, ranks_held)
            own = [(int(e), *window(len(ctx.examples()[int(e)][0]), int(p)))
                   for e, p in zip(held["example_id"], held["position"])]
            texts[t] = own + [w for w in randoms[t.layer] if w[0] not in seen]
        tokens = _token_ids(ctx, sorted({w[0] for ws in texts.values() for w in ws}))
        truth = coefficients_of(ctx, targets, lambda t: [tokens[w[0]] for w in texts[t]])
        # Each (explanation, text) pair to simulate, asked once per prompt hash.
        journal = Journal(run_dir, SIMULATIONS, metric=False, step="score", every=max(4, simulator.concurrency),
                          columns=(KEY, "values", "expected"))
        done = set(journal.done()[KEY])
        plan: list[tuple[int, str, int, list[str]]] = []  # (target row, baseline, source row, prompt hashes)
        jobs, asked, n_tokens = [], set(), 0
        for i, t in enumerate(targets):
            for baseline, source in (("own", i), ("shuffled", int(shuffled[i]))):
                if source < 0:
                    continue
                explanation = str(rows.at[source, "explanation"])
                hashes = []
                for e, start, end in texts[t]:
                    pieces = [piece(ctx, x) for x in tokens[e][start:end]]
                    messages = simulation_messages(explanation, pieces)
                    h = prompt_hash(simulator.answerer, messages, 0)
                    hashes.append(h)
                    if h in done or h in asked:
                        continue
                    asked.add(h)
                    n_tokens += simulator.count_tokens(messages)
                    jobs.append((h, _simulate(simulator, messages, len(pieces), h)))
                plan.append((i, baseline, source, hashes))
        say(f"score: {len(jobs)} simulations by {simulator.identity}, about {n_tokens:,} prompt tokens; "
            f"{len(done)} already stored; held out per explanation: up to {top_examples} top-activating examples "
            f"(odd ranks) and {random_examples} random windows")
        try:
            run_requests(simulator, jobs, journal, "score", progress)
        finally:
            sims = journal.close({"simulator": simulator.identity})
        by_hash = {h: (np.asarray(v, float), bool(x)) for h, v, x in
                   zip(sims[KEY], sims["values"], sims["expected"])}
        scores = []
        for i, baseline, source, hashes in plan:
            t = targets[i]
            true = np.concatenate([a[s:e] for a, (_, s, e) in zip(truth[t], texts[t])])
            predicted = np.concatenate([by_hash[h][0] for h in hashes])
            scores.append({"kind": t.kind, "layer": t.layer, "key": t.key, "direction": t.direction,
                           "explainer": rows.at[i, "explainer"], "baseline": baseline,
                           "explanation_key": int(rows.at[source, "key"]),
                           "explanation": str(rows.at[source, "explanation"]),
                           "score": correlation(predicted, true), "n_texts": len(hashes), "n_tokens": len(true),
                           "simulator": simulator.identity, "expected": all(by_hash[h][1] for h in hashes)})
        description = {"model_id": ctx.loaded.model_id, "simulator": simulator.identity, "seed": seed,
                       "held_out": f"up to {top_examples} top-activating trigger examples (odd ranks, never shown to "
                                   f"the explainer) and {random_examples} random windows of {WINDOW} tokens per "
                                   "explanation",
                       "score": "Pearson correlation of simulated and true activations d*m over the held-out tokens",
                       "baselines": "shuffled: another memory's explanation (same layer and direction, seeded); "
                                    "control: the random control memories' own explanations"}
        table = pd.concat([_other_layers(run_dir, set(rows["layer"]), explained, description, say),
                           pd.DataFrame(scores)],
                          ignore_index=True).sort_values(["layer", "kind", "key", "direction"], kind="stable")
        table = table.reset_index(drop=True)
        layer_table = by_layer(table)
        run_dir.write_metric(SCORES, table, description, step="score")
        run_dir.write_metric(BY_LAYER, layer_table, description, step="score")
        if table["kind"].isin(LATENT_KINDS).any() or run_dir.has_metric(LATENTS):
            kinds = {int(layer): str(d["kind"]) for layer, d in (manifest.index.get("dictionary") or {}).items()}
            run_dir.write_metric(LATENTS, latents_by_layer(table, kinds),
                                 {**description, "difference": "per memory own - shuffled, the latents' mean minus "
                                                               "the neurons' (independent samples, normal interval)"},
                                 step="score")
    return table, layer_table


def _other_layers(run_dir, scored: set[int], explained: pd.DataFrame, description: dict,
                  say: Callable[[str], None]) -> pd.DataFrame:
    """The stored scores of the layers this call does not score (``--layers``), kept when they were computed the
    same way (simulator, seed, held-out mix) and each scored explanation is still its memory's (`explained`, the
    explanations table now: `ffkv explain` replaces one whose prompt changed); otherwise dropped, with a line
    saying which and why."""
    if not run_dir.has_metric(SCORES):
        return pd.DataFrame()
    before = run_dir.read_metric(SCORES)
    others = before[~before["layer"].isin(list(scored))]
    if not len(others):
        return pd.DataFrame()
    then = run_dir.metric_description(SCORES)
    changed = [k for k in ("model_id", "simulator", "seed", "held_out") if then.get(k) != description[k]]
    if changed:
        layers = ", ".join(str(int(x) + 1) for x in sorted(others["layer"].unique()))
        say(f"score: the stored scores of layers {layers} were computed with another {' and '.join(changed)}; "
            f"they are dropped (score those layers again to have them beside these)")
        return pd.DataFrame()
    own = others[others["baseline"] == "own"].merge(explained, on=ONE_PER, how="left", suffixes=("", "_now"))
    stale = sorted(set(own.loc[own["explanation"] != own["explanation_now"], "layer"]))
    if stale:
        layers = ", ".join(str(int(x) + 1) for x in stale)
        say(f"score: the explanations of layers {layers} have changed since they were scored (`ffkv explain` "
            "replaced some); their stored scores are dropped (score those layers again)")
        others = others[~others["layer"].isin(stale)]
    return others


def _simulate(simulator: Backend, messages: list[Message], n: int, h: str) -> Callable[[], dict]:
    def ask() -> dict:
        s = simulator.simulate(messages, n)
        return {KEY: h, "values": [float(v) for v in s.values], "expected": s.expected,
                "prompt_tokens": s.prompt_tokens, "completion_tokens": s.completion_tokens}
    return ask


#: The columns of `summary` (each with _ci_low, _ci_high, and n_ for the first three).
SUMMARY = ("score", "shuffled", "control", "score_minus_shuffled")


def summary(t: pd.DataFrame, kind: str = "memory") -> dict:
    """The scores of one layer and explainer for one kind of real memory ("memory" or "latent"): the mean score of
    their own explanations with its 95% interval and n, beside the shuffled baseline, their controls' own scores
    (`CONTROL_OF`), and the paired difference own - shuffled."""
    own = t[(t["kind"] == kind) & (t["baseline"] == "own")]
    shuffled = t[(t["kind"] == kind) & (t["baseline"] == "shuffled")]
    control = t[(t["kind"] == CONTROL_OF[kind]) & (t["baseline"] == "own")]
    row: dict = {}
    for name, part in (("score", own), ("shuffled", shuffled), ("control", control)):
        mean, low, high = paired_mean_interval(part["score"].to_numpy())
        row.update({name: mean, f"{name}_ci_low": low, f"{name}_ci_high": high,
                    f"n_{name}": int(np.isfinite(part["score"].to_numpy(float)).sum())})
    mean, low, high = paired_mean_interval(_own_minus_shuffled(own, shuffled))
    row.update({"score_minus_shuffled": mean, "score_minus_shuffled_ci_low": low,
                "score_minus_shuffled_ci_high": high})
    return row


def _own_minus_shuffled(own: pd.DataFrame, shuffled: pd.DataFrame) -> np.ndarray:
    """Per memory, its own explanation's score minus the shuffled one's (paired by memory)."""
    paired = own.merge(shuffled, on=["key", "direction", "explainer"], suffixes=("", "_s"))
    return (paired["score"] - paired["score_s"]).to_numpy()


def by_layer(table: pd.DataFrame) -> pd.DataFrame:
    """Per layer and explainer (one row per layer where one explainer wrote them all): the mean score of the real
    memories' own explanations with its 95% interval, beside the shuffled baseline, the control memories'
    scores, and the paired difference own - shuffled. Explainers are never pooled. The neurons' rows alone: a
    dictionary's latents are summarised apart (`latents_by_layer`)."""
    neurons = table[table["kind"].isin(NEURON_KINDS)] if len(table) else table
    out = [{"layer": int(layer), "explainer": str(explainer), **summary(t)}
           for (layer, explainer), t in neurons.groupby(["layer", "explainer"], sort=True)]
    return pd.DataFrame(out, columns=["layer", "explainer", *_summary_columns()])


def _summary_columns() -> list[str]:
    return [c for name in SUMMARY for c in (name, f"{name}_ci_low", f"{name}_ci_high",
                                            *([f"n_{name}"] if name != "score_minus_shuffled" else []))]


def latents_by_layer(table: pd.DataFrame, dictionaries: dict[int, str]) -> pd.DataFrame:
    """Per dictionary layer with latents scored, and explainer: the latents' `summary` (columns suffixed _latents)
    beside the neurons' of the same layer and explainer (suffixed _neurons; NaN and n 0 where none were scored),
    and the latents' mean own - shuffled minus the neurons' (excess_latents_minus_neurons, with a 95% interval:
    independent samples). `dictionaries`: layer -> its dictionary's kind (transcoder, sae)."""
    rows = []
    latent = table[table["kind"] == "latent"] if len(table) else table
    for (layer, explainer), _ in latent.groupby(["layer", "explainer"], sort=True):
        t = table[(table["layer"] == layer) & (table["explainer"] == explainer)]
        row = {"layer": int(layer), "dictionary": dictionaries.get(int(layer), ""), "explainer": str(explainer)}
        for kind, suffix in (("latent", "latents"), ("memory", "neurons")):
            row.update({_suffixed(k, suffix): v for k, v in summary(t, kind).items()})
        excess = [_own_minus_shuffled(t[(t["kind"] == kind) & (t["baseline"] == "own")],
                                      t[(t["kind"] == kind) & (t["baseline"] == "shuffled")])
                  for kind in ("latent", "memory")]
        mean, low, high = mean_difference_interval(*excess)
        row.update({"excess_latents_minus_neurons": mean, "excess_latents_minus_neurons_ci_low": low,
                    "excess_latents_minus_neurons_ci_high": high})
        rows.append(row)
    columns = ["layer", "dictionary", "explainer",
               *(_suffixed(c, s) for s in ("latents", "neurons") for c in _summary_columns()),
               "excess_latents_minus_neurons", "excess_latents_minus_neurons_ci_low",
               "excess_latents_minus_neurons_ci_high"]
    return pd.DataFrame(rows, columns=columns)


def _suffixed(column: str, suffix: str) -> str:
    """score_ci_low -> score_latents_ci_low: the kind goes before an interval's end, as the studies write it."""
    for end in ("_ci_low", "_ci_high"):
        if column.endswith(end):
            return f"{column[:-len(end)]}_{suffix}{end}"
    return f"{column}_{suffix}"


__all__ = ["BY_LAYER", "LATENTS", "RANDOM_EXAMPLES", "SCORES", "TOP_EXAMPLES", "by_layer", "correlation",
           "latents_by_layer", "random_windows", "score", "shuffled_sources", "simulation_messages", "summary"]
