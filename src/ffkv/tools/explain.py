"""`ffkv explain RUN`: one sentence per memory from a language model, as in Bills et al. (2023).

For each memory chosen (a seeded sample per layer, or named ones) and each direction of a signed model (the
largest coefficients and the most negative ones, each explained on its own), the explainer is shown:

- the memory's top trigger examples of that direction, the even ranks 0, 2, 4, ... (`shown_ranks`; the odd
  ranks are kept back for `ffkv score`), each a window of tokens ending a few tokens after the trigger position,
  every token followed by its activation on a 0-10 scale in double brackets where it is not 0 (``Paris[[7]]``);
  the activation is the direction's coefficient d·m_i, clipped at 0 and scaled by its largest value over the
  examples shown (`ffkv.tools.activations`);
- the value's top tokens under the run's value projection (`ffkv.memories.projection.scan_values`; for the
  negative direction those of -v_i, what a negative coefficient writes);

and answers with one sentence. The random control memories (`ffkv.memories.controls`) are explained the same
way when asked (`controls`), as the baseline an explanation must beat.

A run indexed with a sparse dictionary (`ffkv index --dictionary`) has a second kind of memory, its latents (docs/definitions.md:
key e_j, coefficient a_j, value d_j), and their control latents (`ffkv.memories.latent_keys`). Asked
for (`latents`, or latents named ``tLAYER:LATENT``), they are explained with the same prompt: their trigger
examples (one direction: a_j is never negative), their activations a_j as the index computes them
(`ffkv.tools.activations.token_latent_activations`), their decoder row's top tokens; a sample is drawn among the
latents that fired over the corpus (a dead latent has no example to show). Their rows have their own kinds,
"latent" and "latent_control" (`ffkv.experiments.explanations.KINDS`), never mixed with the neurons'.

Stored in RUN/metrics/explanations.parquet: one row per (kind, layer, key, direction) with the explanation, the
explainer's identity, the prompt's SHA-256 and the tokens spent. Rows are kept as they arrive
(`ffkv.tools.journal`): a killed or failed command loses nothing finished, and a new one sends only the prompts
whose hash (explainer, messages, answer length) is not stored yet.
"""

from __future__ import annotations

import hashlib
import json
import sys
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import pandas as pd

from ffkv.errors import FfkvError, warn
from ffkv.experiments.common import Projections, RunContext, open_run, progress_bar
from ffkv.experiments.explanations import CONTROL_OF, EXPLANATIONS, KINDS, LATENT_KINDS, ONE_PER
from ffkv.memories.address import LatentRef, MemoryLayout, MemoryRef
from ffkv.memories.controls import RandomKeys
from ffkv.memories.projection import scan_values
from ffkv.store.lock import now_iso
from ffkv.tools.activations import token_coefficients, token_latent_activations
from ffkv.tools.journal import Journal
from ffkv.tools.llm_backends import Backend, EmptyAnswer, Message

#: The metrics table (its name's owner: `ffkv.experiments.explanations`, the report's section).
TABLE = EXPLANATIONS
#: Memories per layer when none are named (seeded).
DEFAULT_SAMPLE = 10
#: Trigger examples shown to the explainer (the even ranks), tokens per example window, tokens after the trigger.
SHOWN = 10
WINDOW = 32
AFTER = 4
#: Value tokens shown.
VALUE_TOKENS = 10
#: Tokens the explainer may write.
MAX_TOKENS = 60
#: The columns every row of the explanations journal holds (a chunk without them is not this journal's).
JOURNAL_COLUMNS = ("row", "kind", "layer", "key", "direction", "explainer", "prompt_sha256", "explanation")

SYSTEM = ("You are studying the memories of a language model's feed-forward layers. Each memory activates on some "
          "tokens of a text, and when it does it pushes the model towards some output tokens. Read the examples "
          "and explain in one short sentence what the memory responds to.")


@dataclass(frozen=True)
class Target:
    """One thing to explain: memory `key` of `layer` (0-based) in direction +1 or -1; `kind` "control" for the
    random control memory `key` of that layer, "latent" for latent `key` of the layer's dictionary (direction +1),
    "latent_control" for its control latent `key`."""

    kind: str
    layer: int
    key: int
    direction: int

    @property
    def name(self) -> str:
        return f"{self.kind}/{self.layer}/{self.key}/{'+' if self.direction > 0 else '-'}"

    @property
    def latent(self) -> bool:
        """Whether it is a dictionary's latent or control latent."""
        return self.kind in LATENT_KINDS

    @property
    def control(self) -> bool:
        """Whether it is a control (a random key direction, or a control latent)."""
        return self.kind in CONTROL_OF.values()


def shown_ranks(top_k: int, shown: int = SHOWN) -> list[int]:
    """The trigger ranks an explainer sees (0-based, even, at most `shown`); the odd ranks are held out."""
    return list(range(0, top_k, 2))[:shown]


def held_out_ranks(top_k: int, n: int) -> list[int]:
    """The trigger ranks `ffkv score` simulates, never shown to the explainer: the odd ranks, at most `n`."""
    return list(range(1, top_k, 2))[:n]


def window(n_tokens: int, position: int, width: int = WINDOW, after: int = AFTER) -> tuple[int, int]:
    """[start, end) of the tokens shown of an example of `n_tokens` around its trigger `position`."""
    end = min(n_tokens, position + after + 1)
    return max(0, end - width), end


def prompt_hash(identity: str, messages: Sequence[Message], max_tokens: int) -> str:
    """The SHA-256 a request is stored and de-duplicated by: which model answers (`Backend.answerer`), what is
    asked, how long an answer may be."""
    text = json.dumps({"by": identity, "messages": list(messages), "max_tokens": max_tokens}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def choose_targets(ctx: RunContext, layers: Sequence[int] | None = None,
                   memories: Sequence[tuple[int, int] | LatentRef] = (), sample: int = DEFAULT_SAMPLE,
                   controls: int = 0, seed: int = 0, direction: str = "both", latents: bool = False) -> list[Target]:
    """The memories to explain (layers 0-based), each in every direction the run holds (`direction` "both"), or
    in one ("positive", "negative"); a latent in its one direction, +1.

    Args:
        layers: layers to sample from (default all, or with `latents` every layer with a dictionary; ignored when
            `memories` names some).
        memories: (layer, key) pairs of neurons and `LatentRef`s of latents to explain; when given, no sample is
            drawn.
        sample: memories drawn per layer (seeded by (seed, layer); all when larger than the layer).
        controls: random control memories drawn per layer the same way (0: none); the layer's control latents for
            its latents.
        latents: draw the sample from the dictionary's latents (those that fired over the corpus) instead of the
            neurons.
    """
    view = ctx.view
    directions = (1, -1) if ctx.manifest.sign == "both" else (1,)
    if direction not in ("both", "positive", "negative"):
        raise FfkvError(f"direction must be both, positive or negative, got {direction!r}")
    named_latents = [m for m in memories if isinstance(m, LatentRef)]
    named = [(int(m[0]), int(m[1])) for m in memories if not isinstance(m, LatentRef)]
    if latents and memories:
        raise FfkvError("--latents draws a sample of the dictionary's latents and --memories names what to explain "
                        "(a latent as tLAYER:LATENT): give one of them")
    layout = _latent_layout(ctx) if latents or named_latents else None
    if layout is not None and direction == "negative":
        raise FfkvError("a latent has one direction (its activation is never negative): leave out "
                        "--direction negative to explain latents")
    if direction == "negative" and -1 not in directions:
        raise FfkvError(f"{ctx.run.path} holds only the positive direction (indexed with --sign positive)")
    if direction != "both":
        directions = (1,) if direction == "positive" else (-1,)
    if controls and (named or not (memories or latents)) and not ctx.has_control:
        raise FfkvError(f"{ctx.run.path} holds no random-key control; index again with --control-keys N, or "
                        "leave out --controls")
    if controls and (latents or named_latents) and not ctx.has_latent_control:
        raise FfkvError(f"{ctx.run.path} holds no control latents; index again with --control-keys N, or leave out "
                        "--controls")
    for layer, key in named:
        if not (0 <= layer < view.n_layers and 0 <= key < view.d_m):
            raise FfkvError(f"memory {layer + 1}:{key} does not exist: this run has layers 1 to {view.n_layers} and "
                            f"memories 0 to {view.d_m - 1}")
    for ref in named_latents:
        ref = layout.check_latent(ref.layer, ref.latent, ref.kind)
        if ref.latent not in _live(ctx, "latent", ref.layer):
            raise FfkvError(f"latent {ref} never fired over the indexed corpus: it has no trigger example to explain")
    if latents:
        chosen = sorted(layout.latents) if layers is None else list(layers)
        for layer in chosen:
            layout.check_latent(layer, 0)
    else:
        chosen = [layer for layer in (range(view.n_layers) if layers is None else layers)]
        for layer in chosen:
            if not 0 <= layer < view.n_layers:
                raise FfkvError(f"layer {layer + 1} does not exist: this run has layers 1 to {view.n_layers}")
    out: list[Target] = []
    if memories:
        pairs = [("memory", layer, key) for layer, key in named]
        pairs += [("latent", ref.layer, ref.latent) for ref in named_latents]
    elif latents:
        pairs = []
        for layer in chosen:
            rng = np.random.default_rng([seed, layer, 3])
            live = _live(ctx, "latent", layer)
            pairs += [("latent", layer, int(k)) for k in sorted(live[rng.permutation(len(live))[:sample]])]
    else:
        pairs = []
        for layer in chosen:
            rng = np.random.default_rng([seed, layer])
            pairs += [("memory", layer, int(k)) for k in sorted(rng.permutation(view.d_m)[:sample])]
    if controls:
        for real, control in CONTROL_OF.items():
            for layer in sorted({layer for kind, layer, _ in pairs if kind == real}):
                if real == "memory":
                    rng = np.random.default_rng([seed, layer, 1])
                    drawn = rng.permutation(ctx.manifest.control_keys)[:controls]
                else:
                    rng = np.random.default_rng([seed, layer, 4])
                    live = _live(ctx, control, layer)
                    drawn = live[rng.permutation(len(live))[:controls]]
                pairs += [(control, layer, int(k)) for k in sorted(drawn)]
    for kind, layer, key in pairs:
        out += [Target(kind, layer, key, d) for d in ((1,) if kind in LATENT_KINDS else directions)]
    return out


def _latent_layout(ctx: RunContext) -> MemoryLayout:
    """The latents the run can name, or a refusal naming what to do where it was indexed without a dictionary."""
    if not ctx.has_latents:
        raise FfkvError(f"{ctx.run.path} was indexed without a dictionary: it has no latents to explain (index it "
                        "with `ffkv index --dictionary PATH`, or leave out --latents)")
    return MemoryLayout.recorded(ctx.view.n_layers, ctx.view.d_m, ctx.manifest.index.get("dictionary"))


def _live(ctx: RunContext, kind: str, layer: int) -> np.ndarray:
    """The latents (or control latents) of `layer` that fired over the indexed corpus: those with trigger rows."""
    trig = ctx.triggers(1, control=kind != "latent", source="latents")
    return np.unique(trig.loc[trig["layer"] == layer, "key"].to_numpy(np.int64))


@dataclass
class Shown:
    """What a target's prompt is made of: its examples' windows (token ids, activations 0-10) and its value's
    top tokens."""

    examples: list[tuple[list[int], list[int]]]
    value_tokens: list[int]


def _control(ctx: RunContext) -> RandomKeys:
    return ctx.once("random_keys", lambda: RandomKeys(ctx.view, ctx.manifest.control_keys,
                                                      ctx.manifest.identity.index.get("control_seed", 0)))


def trigger_rows(ctx: RunContext, target: Target, ranks: Sequence[int]) -> pd.DataFrame:
    """The target's trigger rows of the given ranks, in rank order."""
    trig = ctx.triggers(target.direction, control=target.control, source="latents" if target.latent else "neurons")
    index = ctx.once(("trigger_index", target.direction, target.kind),
                     lambda: trig.groupby(["layer", "key"]).indices)
    rows = trig.iloc[index.get((target.layer, target.key), [])]
    return rows[rows["rank"].isin(list(ranks))].sort_values("rank")


def coefficients_of(ctx: RunContext, targets: Sequence[Target], token_lists: Callable[[Target], list]) \
        -> dict[Target, list[np.ndarray]]:
    """d·m of each target at every token of its examples (`token_lists(target)`; a latent's a_j), one pass per
    layer and kind, each distinct token list read once (a layer's memories share many of their top examples)."""
    out: dict[Target, list[np.ndarray]] = {}
    groups: dict[tuple[str, int], list[Target]] = {}
    for t in targets:
        groups.setdefault((t.kind, t.layer), []).append(t)
    for (kind, layer), group in groups.items():
        keys = sorted({t.key for t in group})
        lists, owners = [], []
        for t in group:
            for ids in token_lists(t):
                lists.append(ids)
                owners.append(t)
        control = _control(ctx) if kind == "control" else None
        texts = [tuple(int(i) for i in ids) for ids in lists]
        distinct: dict[tuple[int, ...], int] = {}
        for text in texts:
            distinct.setdefault(text, len(distinct))
        lists = [list(text) for text in distinct]
        if kind in LATENT_KINDS:
            m = token_latent_activations(ctx.loaded, ctx.latent_keys(), layer, keys, lists,
                                         control=kind == "latent_control")
        else:
            m = token_coefficients(ctx.loaded, layer, keys, lists, control=control)
        column = {k: i for i, k in enumerate(keys)}
        for t, text in zip(owners, texts):
            out.setdefault(t, []).append(t.direction * m[distinct[text]][:, column[t.key]])
    return out


def value_top_tokens(ctx: RunContext, targets: Sequence[Target], projection: str, n: int = VALUE_TOKENS) \
        -> dict[Target, list[int]]:
    """Each target's value top tokens (a control memory's borrowed value; -v for the negative direction; a latent's
    decoder row, a control latent's borrowed one)."""
    out: dict[Target, list[int]] = {}
    groups: dict[tuple[str, int, int], list[Target]] = {}
    for t in targets:
        groups.setdefault((t.kind, t.layer, t.direction), []).append(t)
    for (kind, layer, direction), group in groups.items():
        keys = np.array([t.key for t in group])
        if kind == "control":
            keys = ctx.control_sources()[layer][keys]
        elif kind == "latent_control":
            keys = ctx.latent_control_sources()[layer][keys]
        memories = ctx.memories("latents") if kind in LATENT_KINDS else None
        tops = scan_values(ctx.view, layer, projection, np.full(len(keys), -1), top=n, sign=direction,
                           keys=keys, memories=memories)["top_token_ids"]
        out.update({t: [int(i) for i in row] for t, row in zip(group, tops)})
    return out


def scaled(activations: Sequence[np.ndarray]) -> list[np.ndarray]:
    """Activations on the 0-10 scale of the prompts: clipped at 0, over the largest of them all, rounded."""
    top = max((float(a.max()) for a in activations if len(a)), default=0.0)
    if top <= 0:
        return [np.zeros(len(a), dtype=int) for a in activations]
    return [np.clip(np.rint(10 * np.clip(a, 0, None) / top), 0, 10).astype(int) for a in activations]


def gather(ctx: RunContext, targets: Sequence[Target], projection: str, shown: int = SHOWN) -> dict[Target, Shown]:
    """What each target's prompt shows (its windows with activations, its value tokens)."""
    examples = ctx.examples()
    ranks = shown_ranks(ctx.top_k, shown)
    rows = {t: trigger_rows(ctx, t, ranks) for t in targets}
    m = coefficients_of(ctx, targets, lambda t: [examples[int(e)][0] for e in rows[t]["example_id"]])
    values = value_top_tokens(ctx, targets, projection)
    out = {}
    for t in targets:
        windows, acts = [], []
        for (e, p), a in zip(zip(rows[t]["example_id"], rows[t]["position"]), m.get(t, [])):
            ids = examples[int(e)][0]
            start, end = window(len(ids), int(p))
            windows.append([int(i) for i in ids[start:end]])
            acts.append(a[start:end])
        out[t] = Shown(list(zip(windows, [list(map(int, s)) for s in scaled(acts)])), values[t])
    return out


def piece(ctx: RunContext, token_id: int) -> str:
    """A token as text in a prompt (decoded alone; line breaks and tabs written as escapes)."""
    try:
        text = ctx.tokenizer.decode([int(token_id)])
    except Exception:  # noqa: BLE001 - ids past the tokenizer's own vocabulary
        text = ctx.token(token_id)
    return text.replace("\n", "\\n").replace("\t", "\\t")


def explain_messages(ctx: RunContext, target: Target, shown: Shown) -> list[Message]:
    """The explainer's chat for one target."""
    which = "most strongly" if target.direction > 0 else "most strongly in the negative direction (its activation " \
                                                         "here is minus its coefficient)"
    lines = [f"Here are text excerpts on which a memory activates {which}. After every token it activates on, its "
             "activation on a 0-10 scale is written in double brackets, e.g. Paris[[7]]; tokens without brackets "
             "have activation 0.", ""]
    for i, (ids, acts) in enumerate(shown.examples, 1):
        text = "".join(piece(ctx, t) + (f"[[{a}]]" if a else "") for t, a in zip(ids, acts))
        lines.append(f"Example {i}: {text}")
    tokens = ", ".join(json.dumps(piece(ctx, t), ensure_ascii=False) for t in shown.value_tokens)
    lines += ["", f"When it activates, it pushes the model towards these output tokens: {tokens}.", "",
              "In one sentence, what does this memory respond to? Answer with the sentence only."]
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "\n".join(lines)}]


def first_sentence(text: str) -> str:
    """The answer's first non-empty line, trimmed (an explanation is one sentence)."""
    line = next((s.strip() for s in text.strip().splitlines() if s.strip()), "")
    return line[:400]


def run_requests(backend: Backend, jobs: Sequence[tuple[str, Callable[[], dict]]], journal: Journal,
                 bar_name: str, progress: bool) -> list[str]:
    """Send `jobs` ((row key, request)) `backend.concurrency` at a time, keeping each finished row in `journal`.

    The first failure stops new requests; those in flight finish and are kept; then it is raised. So is Ctrl-C.
    An answer refused as empty (`EmptyAnswer`) stops nothing and keeps nothing: what it was for is returned.
    """
    refused: list[str] = []
    bar = progress_bar(progress, len(jobs), bar_name, "request")
    pool = ThreadPoolExecutor(max_workers=max(1, backend.concurrency))
    error: BaseException | None = None
    try:
        queue = list(jobs)[::-1]
        running = set()
        while queue or running:
            while queue and len(running) < backend.concurrency and error is None:
                running.add(pool.submit(queue.pop()[1]))
            if not running:
                break
            finished, running = wait(running, return_when=FIRST_COMPLETED)
            for future in finished:
                try:
                    journal.add(future.result())
                    bar.update(1)
                except EmptyAnswer as exc:
                    refused.append(str(exc))
                    bar.update(1)
                except Exception as exc:  # noqa: BLE001 - the first one is raised once the others are kept
                    error = error or exc
            if error is not None:
                queue = []
    except BaseException:
        pool.shutdown(wait=True, cancel_futures=True)
        journal.flush()
        raise
    finally:
        bar.close()
    pool.shutdown(wait=True)
    if error is not None:
        raise error
    return refused


def explain(run, backend: Backend, *, layers: Sequence[int] | None = None,
            memories: Sequence[tuple[int, int] | LatentRef] = (), sample: int = DEFAULT_SAMPLE, controls: int = 0,
            seed: int = 0, direction: str = "both", latents: bool = False, projection: str | None = None,
            loaded=None, progress: bool = True, say: Callable[[str], None] | None = None) -> pd.DataFrame:
    """Explain memories of a complete run (module docstring); the explanations table's rows, every one stored.

    Args:
        run: the run directory.
        backend: the explainer (`ffkv.tools.llm_backends.open_backend`).
        layers, memories, sample, controls, seed, direction, latents: which memories (`choose_targets`; 0-based
            layers): the model's neurons, or with `latents` (or latents named in `memories`) the latents of the
            dictionary the run was indexed with.
        projection: the value projection (`ffkv analyze --projection`; default the run's default, identity).
        say: where the line before starting goes (default stderr).
    """
    say = say or (lambda line: print(line, file=sys.stderr))
    run_dir, manifest, loaded = open_run(run, loaded)
    ctx = RunContext(run_dir, manifest, loaded, projections=Projections.choose(projection), progress=progress,
                     seed=seed)
    with run_dir.lock("explain"):
        targets = choose_targets(ctx, layers, memories, sample, controls, seed, direction, latents)
        shown = gather(ctx, targets, ctx.projections.values)
        journal = Journal(run_dir, TABLE, metric=True, step="explain", every=max(4, backend.concurrency), key="row",
                          columns=JOURNAL_COLUMNS)
        done = journal.done()
        answers = {h: r for h, r in zip(done.get("prompt_sha256", []), done.to_dict("records"))}
        stored = set(done["row"])
        jobs, tokens, reused = [], 0, []
        sent: set[str] = set()
        current: dict[tuple, str] = {}  # each target's row under its prompt now
        for t in targets:
            messages = explain_messages(ctx, t, shown[t])
            h = prompt_hash(backend.answerer, messages, MAX_TOKENS)
            row_key = f"{t.name}|{h}"
            current[(t.kind, t.layer, t.key, t.direction, backend.identity)] = row_key
            if row_key in stored:
                continue
            base = {"row": row_key, "kind": t.kind, "layer": t.layer, "key": t.key, "direction": t.direction,
                    "explainer": backend.identity, "prompt_sha256": h, "projection": ctx.projections.values,
                    "examples_shown": len(shown[t].examples)}
            if h in answers or h in sent:  # the same prompt for two memories: asked once
                reused.append((base, h))
                continue
            sent.add(h)
            tokens += backend.count_tokens(messages)
            jobs.append((row_key, _ask(backend, messages, base, _address(ctx, t))))
        say(f"explain: {len(jobs)} requests to {backend.identity}, about {tokens:,} prompt tokens and at most "
            f"{MAX_TOKENS * len(jobs):,} answer tokens; {len(targets) - len(jobs) - len(reused)} of {len(targets)} "
            "already stored")
        try:
            refused = run_requests(backend, jobs, journal, "explain", progress)
            if refused:
                warn(f"explain: {backend.identity} answered {len(refused)} of {len(jobs)} prompts with no "
                     f"explanation (empty or blank), none stored; the next `ffkv explain` asks again for "
                     f"them: {', '.join(refused[:5])}{' ...' if len(refused) > 5 else ''}")
        finally:
            finished = journal.done()
            by_hash = {h: r for h, r in zip(finished["prompt_sha256"], finished.to_dict("records"))} \
                if len(finished) else {}
            for base, h in reused:
                if h in by_hash:
                    journal.add({**by_hash[h], **base, "prompt_tokens": 0, "completion_tokens": 0})
            replaced: list[int] = []
            rows = journal.close(_description(ctx, backend),
                                 order=lambda rows: _order(_superseded_dropped(rows, current, replaced)))
        if sum(replaced):
            say(f"explain: {sum(replaced)} earlier explanations replaced: their memories' prompts have changed since "
                "they were asked (the run's triggers, the projection or ffkv's prompt), and a memory keeps one "
                "explanation per direction and explainer")
    return rows


def _superseded_dropped(rows: pd.DataFrame, current: dict[tuple, str], replaced: list[int]) -> pd.DataFrame:
    """`rows` without the explanations of this call's targets made from an earlier prompt, where the current
    prompt's explanation is stored (`ffkv.experiments.explanations.ONE_PER`); their number goes to `replaced`."""
    if not len(rows):
        return rows
    have = set(rows["row"])
    now = [current.get((str(kind), int(layer), int(key), int(direction), str(explainer)))
           for kind, layer, key, direction, explainer in zip(*(rows[c] for c in ONE_PER))]
    stale = np.array([n is not None and n != r and n in have for n, r in zip(now, rows["row"])], dtype=bool)
    replaced.append(int(stale.sum()))
    return rows[~stale]


def _address(ctx: RunContext, target: Target) -> str:
    """How a reader names the target: ``3:17`` for a neuron or control memory, ``t4:42`` for a latent."""
    if target.latent:
        kind = str(ctx.manifest.index["dictionary"][str(target.layer)]["kind"])
        return str(LatentRef(target.layer, target.key, kind))
    return str(MemoryRef(target.layer, target.key))


def _ask(backend: Backend, messages: list[Message], base: dict, address: str) -> Callable[[], dict]:
    def ask() -> dict:
        answer = backend.chat(messages, MAX_TOKENS)
        explanation = first_sentence(answer.text)
        if not explanation:
            raise EmptyAnswer(f"{base['kind']} {address}")
        return {**base, "explanation": explanation, "prompt_tokens": answer.prompt_tokens,
                "completion_tokens": answer.completion_tokens, "created": now_iso()}
    return ask


def _order(rows: pd.DataFrame) -> pd.DataFrame:
    if not len(rows) or "kind" not in rows:
        return rows
    rows = rows.assign(_k=rows["kind"].map({k: i for i, k in enumerate(KINDS)}))
    rows = rows.sort_values(["_k", "layer", "key", "direction"], ascending=[True, True, True, False], kind="stable")
    return rows.drop(columns="_k").reset_index(drop=True)


def _description(ctx: RunContext, backend: Backend) -> dict:
    return {"model_id": ctx.loaded.model_id, "explainer": backend.identity, "projection": ctx.projections.values,
            "shown": f"the even trigger ranks 0, 2, ... (at most {SHOWN}), windows of {WINDOW} tokens ending "
                     f"{AFTER} after the trigger; {VALUE_TOKENS} value tokens",
            "held_out": "the odd trigger ranks are never shown (ffkv score simulates them)",
            "max_tokens": MAX_TOKENS}


def read_explanations(run_dir) -> pd.DataFrame | None:
    """RUN/metrics/explanations.parquet, or None when the run has none yet."""
    return run_dir.read_metric(TABLE) if run_dir.has_metric(TABLE) else None


__all__ = ["DEFAULT_SAMPLE", "TABLE", "Target", "choose_targets", "explain", "explain_messages", "gather",
           "held_out_ranks", "prompt_hash", "read_explanations", "run_requests", "shown_ranks", "window"]
