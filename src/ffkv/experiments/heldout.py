"""One forward pass over the held-out examples that serves both docs/definitions.md.

For each example, at its one seeded position, every layer: the coefficients m (reduced
at once to the numbers of active memories, positive and negative, and whether an active
memory's signed prediction equals the FF output's top token), and the top tokens of
resid_mid, ff_out and resid_post. Active is the one rule of `ffkv.memories.active`
(|m_i| > tau·s_l; m_i > 0 for ReLU); for activations that go negative, s_l (the RMS of the
layer's coefficients at the analysed positions) is read by a first, coefficient-only pass.
Figures 9-11 are read under both residual projections (identity, the paper's, and the
final normalization, the default) in the same pass: the vectors are projected twice. The
final prediction o is read from the model's own LM head (its input is captured as
``head_in`` and the head is applied to the chosen positions only), so o is what the model
predicts, head bias included. Only (examples x layers) integers and floats are kept.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator, Protocol

import numpy as np
import pandas as pd
import torch

from ffkv.errors import FfkvError
from ffkv.experiments.common import RunContext, as_numpy, eval_spec, mask_token_id, progress_bar
from ffkv.experiments.values import value_tokens
from ffkv.memories.active import active as active_memories
from ffkv.memories.active import RULE, active_fraction, layer_scale
from ffkv.memories.projection import PROJECTIONS, TRANSLATOR, final_logits
from ffkv.memories.projection import logits as project
from ffkv.models.loading import LoadedModel
from ffkv.parallel import gather_rows
from ffkv.store.manifest import Manifest
from ffkv.store.run import RunDir


#: tau of the active rule at which Figure 7 is also read, as a curve, for signed models (`ACTIVE_FRACTION` among them).
TAU_CURVE = (0.05, 0.1, 0.2, 0.3, 0.5)


@dataclass
class ResidualTops:
    """Figures 9-11 under one projection, per example (rows) and layer (columns).

    resid_top: r = argmax p(resid_mid); ff_top: f = argmax p(ff_out); post_top: y = argmax p(resid_post);
    confidence: p(resid_mid)[o]; confidence_chance: p(resid_mid)[o'] for o' the final prediction of the
    example's partner (`EvalCapture.partner`), the permutation chance level of Figure 10.
    """

    resid_top: np.ndarray
    ff_top: np.ndarray
    post_top: np.ndarray
    confidence: np.ndarray
    confidence_chance: np.ndarray


@dataclass
class ActiveScale:
    """s_l of the active rule per layer, and the massive activations left out of it (`ffkv.memories.active`).

    Attributes:
        scale: (L,) s_l, the RMS of the layer's coefficients at the analysed positions that are not massive.
        all_positions: (L,) the same RMS with every position (what s_l would be without the rule).
        massive: one row per (layer, analysed position) left out: layer, row (held-out example), example_id,
            position, token_id, rms (of its coefficients), max_abs (largest |m_i|), times_median (its RMS over
            the layer's median position's).
        n_positions: analysed positions per layer.
        median_rms: (L,) the median position's RMS, which `MASSIVE_FACTOR` multiplies to tell a massive position
            (the census leaves such positions out of its own statistics by the same bound).
    """

    scale: np.ndarray
    all_positions: np.ndarray
    massive: pd.DataFrame
    n_positions: int
    median_rms: np.ndarray


@dataclass
class EvalCapture:
    """Per example (rows, in held-out order) and layer (columns): what sections 7 and 8 read.

    n_active, n_positive, n_negative: active memories (`ffkv.memories.active`), and those with
        m_i > 0 and m_i < 0.
    ff_top: argmax p(ff_out) (values projection).
    ff_matches: whether some active memory's signed sub-update m_i·v_i has the same top token.
    ff_matches_chance: whether some active memory's signed top token equals the FF top token of the example's
        partner (`partner`): the permutation chance level of Figure 8.
    partner: (N,) the row each example is paired with for the chance levels: a seeded cyclic shift of the
        examples within each batch of the held-out pass (a batch groups examples of similar length); an
        example alone in its batch is its own partner and `paired` is False there.
    paired: (N,) bool, the examples whose chance levels count.
    tau_active: (N, L, len(TAU_CURVE)) active memories at each tau of `TAU_CURVE` (signed models; zeros else).
    tau_left_out: (N, L, len(TAU_CURVE)) ‖Σ over the inactive memories of m_i·v_i‖ / ‖Σ_i m_i·v_i‖ at each tau.
    post_top_values / post_matches: the released code's variant, resid_post under the
        values projection, and whether an active memory's signed top token equals it.
    residual: projection name ("identity", "final-norm", and "translator" when the view has fitted
        translators) -> Figures 9-11's r, f, y, confidence.
    final: o, the model's prediction (N,).
    tau, threshold: the rule's fraction, and tau·s_l per layer (L,).
    """

    n_active: np.ndarray
    n_positive: np.ndarray
    n_negative: np.ndarray
    ff_top: np.ndarray
    ff_matches: np.ndarray
    post_top_values: np.ndarray
    post_matches: np.ndarray
    residual: dict[str, ResidualTops]
    final: np.ndarray
    tau: float
    threshold: np.ndarray
    ff_matches_chance: np.ndarray
    partner: np.ndarray
    paired: np.ndarray
    tau_active: np.ndarray
    tau_left_out: np.ndarray


@torch.no_grad()
def memory_predictions(view, layer: int, m: torch.Tensor, keys: torch.Tensor, projection: str,
                       memories=None) -> torch.Tensor:
    """What each memory of `keys` predicts at a position with coefficients m (d_m,): the top token of
    N(m_i·v_i)·Eᵀ, the sign of m_i kept (a negative memory predicts the bottom of v_i·Eᵀ). `memories`: whose
    values (`ffkv.memories.sets`; default the neurons)."""
    values = (memories or view).values(layer)
    sub = m[keys, None].to(values.dtype) * values[keys]
    return project(view, sub, projection).argmax(-1)


def _matches_exact(view, layer: int, m: torch.Tensor, active: torch.Tensor, projection: str, *tops: torch.Tensor,
                   chunk: int = 256) -> list[torch.Tensor]:
    """Whether some active memory's signed sub-update m_i·v_i has each given top token, projecting every one."""
    found = [torch.zeros(m.shape[0], dtype=torch.bool, device=m.device) for _ in tops]
    for b in range(m.shape[0]):
        keys_b = torch.nonzero(active[b])[:, 0]
        for start in range(0, len(keys_b), chunk):
            best = memory_predictions(view, layer, m[b], keys_b[start:start + chunk], projection)
            for f, t in zip(found, tops):
                f[b] |= bool((best == t[b]).any())
    return found


class HeldOutReader(Protocol):
    """A study's reduction of the shared held-out pass (`read_held_out`): built from the context before the pass
    (`reader(ctx)`), it reads each batch's analysed positions and gives its result at the end."""

    quantities: tuple[str, ...]

    def read(self, idx: np.ndarray, state: dict) -> None: ...

    def result(self, rows: np.ndarray) -> Any: ...


def read_held_out(ctx: RunContext, reader: Callable[[RunContext], HeldOutReader]) -> Any:
    """The result of `reader` over the held-out examples' analysed positions: one forward pass per `analyze`.

    The first study that asks runs the pass for itself and for every other study of this call (`ctx.steps`)
    that declares a reader in the registry (`Experiment.held_out_reader`), each reading the same batches; the
    others then find their results here. A study run alone runs the pass for itself."""
    from ffkv.experiments import registry

    results = ctx._shared.setdefault("held_out_pass", {})
    if reader not in results:
        readers = {reader: reader(ctx)}
        declared = (e.held_out_reader for e in map(registry.get, ctx.steps))
        for other in (r for d in declared for r in (d if isinstance(d, tuple) else (d,))):
            if other is not None and other not in results and other not in readers:
                try:
                    readers[other] = other(ctx)
                except Exception:  # noqa: BLE001 - its own step runs the pass again and reports the error as its own
                    continue
        quantities = tuple(dict.fromkeys(q for r in readers.values() for q in r.quantities))
        mine = ctx.batches(held_out_rows(ctx))
        passing = analysed_positions(ctx, mine, quantities, "held-out pass", with_head="head_in" in quantities)
        for idx, state in passing:
            for r, got in list(readers.items()):
                try:
                    got.read(idx, state)
                except Exception:  # noqa: BLE001 - as above: only the asking study's failure is this pass's
                    if r is reader:
                        raise
                    del readers[r]
        results.update({r: got.result(mine.rows) for r, got in readers.items()})
    return results[reader]


def capture_eval(ctx: RunContext) -> EvalCapture:
    """The held-out pass's capture of sections 7 and 8, shared by composition and refinement (`read_held_out`)."""
    return read_held_out(ctx, EvalReader)


def held_out_rows(ctx: RunContext) -> list[tuple[int, np.ndarray]]:
    """(row, token ids) of every held-out example; an encoder's analysed token is masked."""
    held = ctx.held_out()
    mask_id = mask_token_id(ctx.tokenizer) if ctx.view.encoder else None
    if ctx.view.encoder and mask_id is None:  # unmasked, the encoder would see the token it is asked to predict
        raise FfkvError("this encoder's tokenizer has no mask token: the held-out figures (6-11) predict the "
                        "masked token and cannot be computed")
    rows = []
    for i, (e, j) in enumerate(zip(held.examples, held.positions)):
        ids = np.asarray(e.token_ids, dtype=np.int64).copy()
        if mask_id is not None:
            ids[j] = mask_id  # docs/definitions.md: the encoder predicts the masked token
        rows.append((i, ids))
    return rows


def analysed_positions(ctx: RunContext, mine, quantities: tuple[str, ...], label: str,
                       with_head: bool = False) -> Iterator[tuple[np.ndarray, dict]]:
    """Run the held-out batches `mine` (`ctx.batches(held_out_rows(ctx))`) with `quantities` captured at each
    example's analysed position: yields (rows of the batch, {(quantity, layer): (B, ...) tensor}) per
    batch, with a progress bar. Tensors are float32, except ``head_in``, kept in the model's dtype so
    that the head is applied to it as the model would (`ffkv.memories.projection.final_logits`). The dict is reused by the next
    batch: read it before asking for one."""
    view, held = ctx.view, ctx.held_out()
    state: dict = {}
    at: dict = {}

    def sink(name: str, layer: int, t: torch.Tensor) -> None:
        picked = t[at["rows"], at["pos"]]
        state[(name, layer)] = picked if name == "head_in" else picked.float()

    bar = progress_bar(ctx.progress, len(mine.rows), label, "ex")
    try:
        with view.capture(quantities, sink=sink):
            for idx, batch in mine:
                state.clear()
                at["rows"] = torch.arange(len(idx), device=view.device)
                at["pos"] = torch.as_tensor(held.positions[idx], device=view.device)
                view.forward(batch.input_ids, batch.attention_mask, with_head=with_head)
                yield idx, state
                bar.update(len(idx))
    finally:
        bar.close()


@torch.no_grad()
def active_scale(ctx: RunContext) -> ActiveScale:
    """s_l of the active rule, the one owner of it in `ffkv analyze`: per layer, the RMS of the coefficients
    of every memory at the held-out examples' analysed positions, massive-activation positions left out
    (`ffkv.memories.active.layer_scale`). A coefficient-only pass; under torchrun each rank runs its share."""
    def compute() -> ActiveScale:
        view, held = ctx.view, ctx.held_out()
        L, N = view.n_layers, len(held.examples)
        squares = np.zeros((N, L), dtype=np.float64)
        largest = np.zeros((N, L), dtype=np.float64)
        mine = ctx.batches(held_out_rows(ctx))
        for idx, got in analysed_positions(ctx, mine, ("coefficients",), "coefficient scale"):
            for layer in range(L):
                m = got[("coefficients", layer)].double()
                squares[idx, layer] = as_numpy(m.pow(2).sum(-1))
                largest[idx, layer] = as_numpy(m.abs().amax(-1))
        found = gather_rows({"squares": squares, "largest": largest}, mine.rows)
        rms = np.sqrt(found["squares"] / view.d_m)
        scale, plain, rows = np.zeros(L), np.sqrt(found["squares"].sum(0) / (N * view.d_m)), []
        for layer in range(L):
            scale[layer], massive = layer_scale(rms[:, layer])
            median = float(np.median(rms[:, layer]))
            for i in np.flatnonzero(massive):
                e, j = held.examples[i], int(held.positions[i])
                rows.append({"layer": layer, "row": int(i), "example_id": int(e.example_id), "position": j,
                             "token_id": int(e.token_ids[j]), "rms": float(rms[i, layer]),
                             "max_abs": float(found["largest"][i, layer]),
                             "times_median": float(rms[i, layer] / median) if median > 0 else float("inf")})
        massive = pd.DataFrame(rows, columns=["layer", "row", "example_id", "position", "token_id", "rms", "max_abs",
                                              "times_median"])
        return ActiveScale(scale, plain, massive, N, np.median(rms, axis=0))
    return ctx.once("active_scale", compute)


def coefficient_scale(ctx: RunContext) -> np.ndarray:
    """(L,) s_l of the active rule (`active_scale`)."""
    return active_scale(ctx).scale


def active_threshold(ctx: RunContext) -> np.ndarray:
    """(L,) tau·s_l of the active rule, the one threshold every study uses (0 for ReLU models, whose rule is
    m_i > 0)."""
    tau = active_fraction(ctx.view)
    return tau * coefficient_scale(ctx) if tau > 0 else np.zeros(ctx.view.n_layers)


def threshold_source(ctx: RunContext) -> dict:
    """Where `active_threshold` comes from, for a table or file that uses it: the rule, tau, and the held-out
    examples and seed of s_l (none for a model whose rule has no scale)."""
    tau = active_fraction(ctx.view)
    if tau == 0:
        return {"rule": "m_i > 0", "tau": 0.0}
    return {"rule": RULE, "tau": tau, "scale": "s_l of the held-out examples' analysed positions "
            "(ffkv.experiments.heldout.active_scale)", "eval_corpus": ctx.held_out().spec.to_dict(), "seed": ctx.seed}


def run_threshold(run: RunDir, manifest: Manifest, loaded: LoadedModel, seed: int = 0,
                  progress: bool = False) -> tuple[np.ndarray, dict]:
    """(`active_threshold`, `threshold_source`) for a tool outside `analyze` (`ffkv serve` building the explorer's
    lookups, `ffkv prune`): the same owner on the run's own held-out examples as ``ffkv analyze RUN`` reads them
    by default (`eval_spec`: its held-out split, 4,000 examples, seeded); no pass for a model whose rule has no
    scale."""
    ctx = RunContext(run, manifest, loaded, progress=progress, seed=seed,
                     eval_spec=eval_spec(manifest, seed=seed) if active_fraction(loaded.view) > 0 else None)
    return active_threshold(ctx), threshold_source(ctx)


def _partners(n: int, seed: int, first_row: int) -> np.ndarray:
    """A seeded cyclic shift of n rows (positions within a batch): each row's partner for the chance levels,
    never itself when n > 1."""
    if n < 2:
        return np.zeros(n, dtype=np.int64)
    shift = int(np.random.default_rng([seed, 13, first_row]).integers(1, n))
    return (np.arange(n) + shift) % n


class EvalReader:
    """Sections 7 and 8's reduction of the shared held-out pass (`read_held_out`): per example and layer what
    `EvalCapture` holds (after the coefficient-only pass of `active_scale` where the activation goes negative).
    Under torchrun each rank reads its share of the batches; every rank gets every example's row."""

    quantities = ("coefficients", "resid_mid", "ff_out", "resid_post", "head_in")

    def __init__(self, ctx: RunContext) -> None:
        view, held = ctx.view, ctx.held_out()
        L, N = view.n_layers, len(held.examples)
        self.ctx, self.view, self.L, self.N = ctx, view, L, N
        self.pv = ctx.projections.values
        self.tau = active_fraction(view)
        self.threshold = active_threshold(ctx)
        tokens = [value_tokens(ctx, layer) for layer in range(L)]
        self.tops = [torch.as_tensor(t, device=view.device) for t, _ in tokens]
        self.bottoms = [torch.as_tensor(b, device=view.device) for _, b in tokens]
        out = {k: np.zeros((N, L), dtype=dt) for k, dt in (
            ("n_active", np.int32), ("n_positive", np.int32), ("n_negative", np.int32), ("ff_top", np.int64),
            ("ff_matches", bool), ("post_top_values", np.int64), ("post_matches", bool),
            ("ff_matches_chance", bool))}
        self.curve = np.asarray(TAU_CURVE if self.tau > 0 else (), dtype=np.float64)
        self.scale = coefficient_scale(ctx) if self.tau > 0 else np.zeros(L)
        out["tau_active"] = np.zeros((N, L, len(TAU_CURVE)), dtype=np.int32)
        out["tau_left_out"] = np.zeros((N, L, len(TAU_CURVE)), dtype=np.float32)
        out["partner"] = np.arange(N, dtype=np.int64)
        # Figures 9-11 under each residual projection, and under the fitted translators when the view has them
        self.residual_projections = (*PROJECTIONS, TRANSLATOR) if view.translators is not None else PROJECTIONS
        for name in self.residual_projections:
            for k, dt in (("resid_top", np.int64), ("ff_top", np.int64), ("post_top", np.int64),
                          ("confidence", np.float32), ("confidence_chance", np.float32)):
                out[f"{name}/{k}"] = np.zeros((N, L), dtype=dt)
        self.out, self.final = out, np.zeros(N, dtype=np.int64)

    @torch.no_grad()
    def read(self, idx: np.ndarray, state: dict) -> None:
        """One batch of the pass: `state` holds its examples' analysed positions (`analysed_positions`)."""
        view, out, L, pv, device = self.view, self.out, self.L, self.pv, self.view.device
        threshold, tops, bottoms, curve, scale = self.threshold, self.tops, self.bottoms, self.curve, self.scale
        o = final_logits(view, state.get(("head_in", -1)), state[("resid_post", L - 1)]).argmax(-1)
        self.final[idx] = as_numpy(o)
        shift = _partners(len(idx), self.ctx.seed, int(idx[0]))
        out["partner"][idx] = np.asarray(idx)[shift]
        shift = torch.as_tensor(shift, device=device)
        for layer in range(L):
            m = state[("coefficients", layer)]
            active = active_memories(m, float(threshold[layer]))
            positive, negative = active & (m > 0), active & (m < 0)
            ff = project(view, state[("ff_out", layer)], pv).argmax(-1)
            post_v = project(view, state[("resid_post", layer)], pv).argmax(-1)
            if pv == "identity":
                # argmax of m_i·v_i·Eᵀ is v_i's top token when m_i > 0 and its bottom token when
                # m_i < 0: the logits scaled by m_i.
                def hit(t: torch.Tensor) -> torch.Tensor:
                    return (((tops[layer][None, :] == t[:, None]) & positive)
                            | ((bottoms[layer][None, :] == t[:, None]) & negative)).any(-1)
                same_ff, same_post, same_chance = hit(ff), hit(post_v), hit(ff[shift])
            else:
                # A normalization is not scale-free (epsilon, bias, dense layers): project each one.
                same_ff, same_post, same_chance = _matches_exact(view, layer, m, active, pv, ff, post_v, ff[shift])
            values = {"n_active": active.sum(-1), "n_positive": positive.sum(-1),
                      "n_negative": negative.sum(-1), "ff_top": ff, "ff_matches": same_ff,
                      "post_top_values": post_v, "post_matches": same_post, "ff_matches_chance": same_chance}
            if len(curve):  # Figure 7 over tau: active memories, and the share of the FF output the rest write
                values_l = view.values(layer).float()
                full = (m @ values_l).norm(dim=-1).clamp_min(1e-30)
                for c, t in enumerate(curve):
                    off = m.abs() <= t * float(scale[layer])
                    out["tau_active"][idx, layer, c] = as_numpy((~off).sum(-1))
                    out["tau_left_out"][idx, layer, c] = as_numpy(((m * off) @ values_l).norm(dim=-1) / full)
            for name in self.residual_projections:
                z_mid = project(view, state[("resid_mid", layer)], name, layer=layer)
                values[f"{name}/resid_top"] = z_mid.argmax(-1)
                p_mid = torch.softmax(z_mid, -1)
                values[f"{name}/confidence"] = p_mid.gather(1, o[:, None])[:, 0]
                values[f"{name}/confidence_chance"] = p_mid.gather(1, o[shift][:, None])[:, 0]
                values[f"{name}/ff_top"] = ff if name == pv else \
                    project(view, state[("ff_out", layer)], name, layer=layer, update=True).argmax(-1)
                values[f"{name}/post_top"] = post_v if name == pv else \
                    project(view, state[("resid_post", layer)], name, layer=layer).argmax(-1)
            for name, value in values.items():
                out[name][idx, layer] = as_numpy(value)

    def result(self, rows: np.ndarray) -> EvalCapture:
        """The capture, once every batch is read (`rows`: this rank's examples)."""
        out = gather_rows({**self.out, "final": self.final}, rows)  # this rank's examples -> all, under torchrun
        residual = {name: ResidualTops(*(out.pop(f"{name}/{k}") for k in ("resid_top", "ff_top", "post_top",
                                                                            "confidence", "confidence_chance")))
                    for name in self.residual_projections}
        paired = out["partner"] != np.arange(self.N)
        return EvalCapture(**out, residual=residual, tau=self.tau, threshold=np.asarray(self.threshold, dtype=float),
                           paired=paired)
