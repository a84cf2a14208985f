"""`ffkv attribute`: how much each memory contributes to a target over a corpus, by gradients, checked
against switching memories off; and the Backward Lens of the values' gradients.

The target T is a sum over the corpus (every example, every position chosen by `positions`):

- ``loss``: the next-token negative log-likelihood, −log p(x_{p+1} | x_≤p), at positions with a next token;
- a token t: log p(t | x_≤p) (measure ``logprob``) or its logit (measure ``logit``).

Per memory i of layer l (m_i at every position p, summed over positions and examples):

- **gradient × coefficient**: A_i = Σ_p m_i(p)·∂T/∂m_i(p), the first-order estimate of T − T(m_i = 0);
- **integrated gradients** over the coefficient scale: IG_i = Σ_p m_i(p)·∫₀¹ ∂T/∂m_i(p)|_{m_l → α·m_l} dα,
  the path scaling all of layer l's coefficients together from 0 to 1 (other layers as they are), by the
  midpoint rule with `steps` points; per layer Σ_i IG_i ≈ T − T(layer l's coefficients all 0)
  (completeness, reported);
- the **exact effect** of switching the memory off: T − T(m_i = 0 at every position), through
  `ffkv.memories.intervene`, for `check` memories (half the largest |A_i|, half drawn at random, seeded);
  the Spearman rank correlation of each attribution with it is reported.

Both attributions come from gates m' = g ⊙ m (`ffkv.memories.gates`): ∂T/∂g_i is the sum above.

**Backward Lens** (Katz et al. 2024): the gradient of the values, ∂T/∂V_l = Σ_p m(p) ⊗ ∂T/∂FF(x)(p) (an outer
product per position, d_m × d), accumulated over the corpus; row i, the gradient of v_i, projected onto the
vocabulary (identity projection, as values are read): the tokens a gradient step on v_i would write more of
(ascent for a token target, descent for the loss).

**Latents** (with a sparse dictionary, `ffkv.memories.sets.Latents`): a layer's output with latent j's activation
scaled by g_j is FF(x) + (g_j − 1)·a_j·dec_j (the edit `ffkv.memories.intervene` makes: the reconstruction from
the edited latents plus the error term), so its gradient × activation is A_j = Σ_p a_j(p)·(dec_j · ∂T/∂FF(x)(p)),
read from the same backward pass as the neurons' (no pass of its own); the exact effect of switching latents off
and the Backward Lens of the decoder rows (∂T/∂dec_j = Σ_p a_j(p)·∂T/∂FF(x)(p)) as for neurons. Integrated
gradients are the neurons' only (a path over the latents' scale would cost `steps` passes per dictionary layer).

Memory does not grow with the corpus: one batch at a time, running sums of size L × d_m (and the values'
gradients, the size of the FF values; with latents, the same per dictionary layer).
"""

from __future__ import annotations

import json
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import numpy as np
import pandas as pd
import pyarrow as pa
import torch

from ffkv.batching import collate, length_batches, windows
from ffkv.errors import FfkvError
from ffkv.experiments.common import progress_bar
from ffkv.memories.gates import gate_coefficients
from ffkv.memories.interventions import Intervention, intervene
from ffkv.memories.sets import Latents
from ffkv.models.loading import LoadedModel
from ffkv.store import atomic

MEASURES = ("logprob", "logit")
POSITIONS = ("all", "last")


@dataclass(frozen=True)
class Target:
    """What is attributed: the loss (token None) or a token's log-probability or logit, summed over `positions`
    (``all`` real positions, or each example's ``last``)."""

    token: int | None = None
    measure: str = "logprob"
    positions: str = "all"

    def __post_init__(self) -> None:
        if self.measure not in MEASURES:
            raise FfkvError(f"unknown measure {self.measure!r}; choose from {', '.join(MEASURES)}")
        if self.positions not in POSITIONS:
            raise FfkvError(f"unknown positions {self.positions!r}; choose from {', '.join(POSITIONS)}")

    @property
    def name(self) -> str:
        return "loss" if self.token is None else f"{self.measure} of token {self.token}"


@dataclass(frozen=True)
class AttributeOptions:
    """steps: integrated-gradients points (0: none); check: memories switched off exactly; lens_top: memories
    whose values' gradients are projected; batch_size: examples per forward pass; seed: the checked sample."""

    steps: int = 16
    check: int = 32
    lens_top: int = 20
    lens_tokens: int = 10
    batch_size: int = 8
    seed: int = 0

    def validate(self) -> None:
        if self.steps < 0 or self.check < 0 or self.lens_top < 0 or self.lens_tokens < 1 or self.batch_size < 1:
            raise FfkvError("steps, check and lens_top must be >= 0; lens_tokens and batch_size >= 1")


def target_value(logits: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                 target: Target) -> torch.Tensor:
    """T of one padded batch (right padding): a scalar summed over rows and the chosen positions."""
    real = attention_mask.bool()
    if target.token is None:
        chosen = real[:, 1:] & real[:, :-1]          # positions with a next token
        logits = logits[:, :-1]
    else:
        chosen = real
    if target.positions == "last":
        last = chosen.long().cumsum(1).argmax(1)      # the last chosen position of each row
        keep = torch.zeros_like(chosen)
        keep[torch.arange(len(chosen)), last] = True
        chosen = chosen & keep
    picked = logits[chosen]
    if picked.dtype in (torch.float16, torch.bfloat16):  # float32 and float64 models keep their precision
        picked = picked.float()
    if target.token is None:
        gold = input_ids[:, 1:][chosen]
        return -torch.log_softmax(picked, -1).gather(1, gold[:, None]).sum()
    if target.measure == "logit":
        return picked[:, target.token].sum()
    return torch.log_softmax(picked, -1)[:, target.token].sum()


def _batches(loaded: LoadedModel, examples: Iterable, batch_size: int) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """(number of examples, input ids, attention mask) of padded batches of similar length, streamed."""
    special = loaded.special_ids
    for chunk in windows((e for e in examples if len(e.token_ids) >= 2), 16 * batch_size):
        for group in length_batches(chunk, batch_size):
            batch = collate(group, loaded.tokenizer.pad_id, special)
            yield len(group), batch.input_ids.to(loaded.view.device), batch.attention_mask.to(loaded.view.device)


def _logits(loaded: LoadedModel, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    out = loaded.model(input_ids=ids, attention_mask=mask)
    return out.logits if hasattr(out, "logits") else out[0]


@dataclass
class Sums:
    """The running sums of the corpus pass (float64 on the host, the values' gradients float32 on the device)."""

    grad_x_coef: np.ndarray               # (L, d_m)
    integrated: np.ndarray                # (L, d_m)
    value_grads: list[torch.Tensor]       # L x (d_m, d)
    target: float = 0.0
    layer_off: np.ndarray | None = None   # (L,) Σ T(layer l's coefficients all 0)
    n_examples: int = 0
    n_positions: int = 0
    latent_grad_x_act: dict[int, np.ndarray] = field(default_factory=dict)        # layer -> (n_latents,)
    latent_value_grads: dict[int, torch.Tensor] = field(default_factory=dict)     # layer -> (n_latents, d)


def latent_terms(latents: Latents, layer: int, captured: torch.Tensor, ff_out_grad: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """One batch's gradient × activation of each latent of `layer` (n_latents,) and the gradient of its decoder
    rows (n_latents, d), from what the latents read at each position and the FF output's gradient there."""
    d = latents.dictionaries[layer]
    a = d.encode(captured.detach()).reshape(-1, d.n_latents)                  # (positions, n_latents)
    g = ff_out_grad.reshape(-1, ff_out_grad.shape[-1]).to(a.dtype)           # (positions, d)
    return (a * (g @ d.decoder.T)).sum(0), a.T @ g


def attribution_pass(loaded: LoadedModel, examples: Iterable, target: Target, options: AttributeOptions,
                     progress: bool = False, total: int | None = None, latents: Latents | None = None) -> Sums:
    """One streaming pass: gradient × coefficient, integrated gradients, T, T with each layer off, and the
    values' gradients by the outer-product identity; with `latents`, each latent's gradient × activation and
    its decoder row's gradient from the same backward pass (`latent_terms`)."""
    view = loaded.view
    L, d_m = view.n_layers, view.d_m
    sums = Sums(np.zeros((L, d_m)), np.zeros((L, d_m)),
                [torch.zeros(d_m, view.d_model, device=view.device) for _ in range(L)], layer_off=np.zeros(L))
    dictionary_layers = latents.layers if latents is not None else []
    for layer in dictionary_layers:
        d = latents.dictionaries[layer]
        sums.latent_grad_x_act[layer] = np.zeros(d.n_latents)
        sums.latent_value_grads[layer] = torch.zeros(d.n_latents, view.d_model, dtype=d.dtype, device=view.device)
    quantities = tuple(dict.fromkeys(("coefficients", "ff_out", *(latents.reads(l) for l in dictionary_layers))))
    ones = torch.ones(d_m, device=view.device)
    bar = progress_bar(progress, total, "attribute", "ex")
    try:
        for n, ids, mask in _batches(loaded, examples, options.batch_size):
            gates = {layer: ones.clone().requires_grad_(True) for layer in range(L)}
            with torch.enable_grad(), gate_coefficients(view, gates), view.capture(quantities) as cap:
                value = target_value(_logits(loaded, ids, mask), ids, mask, target)
                for t in cap["ff_out"].values():
                    t.retain_grad()
                value.backward()
            sums.target += float(value.detach())
            for layer in range(L):
                sums.grad_x_coef[layer] += gates[layer].grad.double().cpu().numpy()
                sums.value_grads[layer] += value_gradient(cap["coefficients"][layer].detach(),
                                                          cap["ff_out"][layer].grad)
            for layer in dictionary_layers:
                with torch.no_grad():
                    gxa, decoder_grad = latent_terms(latents, layer, cap[latents.reads(layer)][layer],
                                                     cap["ff_out"][layer].grad)
                sums.latent_grad_x_act[layer] += gxa.double().cpu().numpy()
                sums.latent_value_grads[layer] += decoder_grad
            del cap
            for layer in range(L):
                with torch.no_grad(), gate_coefficients(view, {layer: ones * 0}):
                    sums.layer_off[layer] += float(target_value(_logits(loaded, ids, mask), ids, mask, target))
                for k in range(options.steps):
                    alpha = (k + 0.5) / options.steps
                    gate = (ones * alpha).requires_grad_(True)
                    with torch.enable_grad(), gate_coefficients(view, {layer: gate}):
                        target_value(_logits(loaded, ids, mask), ids, mask, target).backward()
                    sums.integrated[layer] += gate.grad.double().cpu().numpy() / options.steps
            sums.n_examples += n
            sums.n_positions += int(_chosen_count(ids, mask, target))
            bar.update(n)
    finally:
        bar.close()
    if sums.n_examples == 0:
        raise FfkvError("no example with two or more tokens in the corpus")
    return sums


def _chosen_count(ids: torch.Tensor, mask: torch.Tensor, target: Target) -> int:
    real = mask.bool()
    chosen = (real[:, 1:] & real[:, :-1]) if target.token is None else real
    return int(chosen.any(1).sum()) if target.positions == "last" else int(chosen.sum())


def value_gradient(m: torch.Tensor, ff_out_grad: torch.Tensor) -> torch.Tensor:
    """∂T/∂V = Σ_positions m ⊗ ∂T/∂FF(x) (Backward Lens): (d_m, d) from m (…, d_m) and the FF output's gradient
    (…, d) at the same positions."""
    m = m.reshape(-1, m.shape[-1]).float()
    g = ff_out_grad.reshape(-1, ff_out_grad.shape[-1]).float()
    return m.T @ g


@torch.no_grad()
def exact_effects(loaded: LoadedModel, examples: Iterable, target: Target, memories: Sequence[Intervention],
                  options: AttributeOptions, progress: bool = False, total: int | None = None) -> np.ndarray:
    """T − T(the memory switched off at every position), summed over the corpus, for each switch-off (a neuron's,
    or a latent's of the dictionary attached to the model): the intervene path."""
    effects = np.zeros(len(memories))
    bar = progress_bar(progress, total, "switch-off check", "ex")
    try:
        for n, ids, mask in _batches(loaded, examples, options.batch_size):
            full = float(target_value(_logits(loaded, ids, mask), ids, mask, target))
            for j, edit in enumerate(memories):
                with intervene(loaded.view, [edit]):
                    effects[j] += full - float(target_value(_logits(loaded, ids, mask), ids, mask, target))
            bar.update(n)
    finally:
        bar.close()
    return effects


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    """Spearman's rank correlation (average ranks for ties); NaN with fewer than 2 values or a constant one."""
    if len(a) < 2:
        return float("nan")
    ra, rb = pd.Series(a).rank().to_numpy(), pd.Series(b).rank().to_numpy()
    if ra.std() == 0 or rb.std() == 0:
        return float("nan")
    return float(np.corrcoef(ra, rb)[0, 1])


def checked_memories(scores: np.ndarray, n: int, seed: int) -> list[tuple[int, int]]:
    """Half the n memories with the largest |score|, half drawn at random (seeded) from the rest."""
    flat = np.abs(scores).reshape(-1)
    n = min(n, flat.size)
    top = list(np.argsort(-flat, kind="stable")[: (n + 1) // 2])
    rest = np.setdiff1d(np.arange(flat.size), top)
    drawn = np.random.default_rng(seed).choice(rest, size=min(n - len(top), rest.size), replace=False)
    return [(int(i) // scores.shape[1], int(i) % scores.shape[1]) for i in sorted(top + list(drawn))]


@dataclass
class Attribution:
    """The result: `memories` one row per memory (layer, key, grad_x_coef, integrated_gradients, exact_off_effect
    where checked); `lens` the top memories' value-gradient tokens; `summary` the target, counts, completeness and
    the rank correlations. With a dictionary, `latents` one row per latent (layer, latent, address, grad_x_act,
    exact_off_effect where checked) and `latent_lens` the top latents' decoder-gradient tokens."""

    memories: pd.DataFrame
    lens: pd.DataFrame
    summary: dict
    latents: pd.DataFrame | None = None
    latent_lens: pd.DataFrame | None = None

    def write(self, out: str | Path) -> list[Path]:
        """OUT/attribute_memories.parquet, OUT/attribute_lens.parquet (with latents also
        attribute_latents.parquet and attribute_latent_lens.parquet) and OUT/attribute.json, atomically."""
        out = Path(out)
        paths = []
        tables = {"memories": self.memories, "lens": self.lens, "latents": self.latents,
                  "latent_lens": self.latent_lens}
        for name, table in tables.items():
            if table is None:
                continue
            arrow = pa.Table.from_pandas(table, preserve_index=False)
            meta = {**(arrow.schema.metadata or {}), b"ffkv": json.dumps(self.summary, default=str).encode()}
            path = out / f"attribute_{name}.parquet"
            atomic.write_parquet(path, arrow.replace_schema_metadata(meta))
            paths.append(path)
        atomic.write_json(out / "attribute.json", self.summary)
        return paths + [out / "attribute.json"]

    def to_text(self, top: int = 10) -> str:
        s = self.summary
        lines = [f"target: {s['target_name']} over {s['n_examples']:,} examples ({s['n_positions']:,} positions); "
                 f"T = {s['target_value']:.4f}"]
        if s.get("spearman_grad_x_coef") is not None:
            integrated = s.get("spearman_integrated_gradients")
            lines.append(f"rank correlation with the exact switch-off effect over {s['n_checked']} memories: "
                         f"gradient x coefficient {s['spearman_grad_x_coef']:.3f}"
                         + (f", integrated gradients {integrated:.3f}" if integrated is not None else ""))
        if s.get("completeness_max_relative_error") is not None:
            lines.append(f"integrated gradients ({s['steps']} steps): per layer, sum vs T - T(layer off): largest "
                         f"relative gap {s['completeness_max_relative_error']:.2e}")
        lines.append(f"top memories (layers from 1), by |gradient x coefficient|:")
        lines += _top_lines(self.memories, self.lens, "key", "grad_x_coef", top, "value",
                            lambda r: f"{r.layer + 1}:{r.key:<6} grad x coef {r.grad_x_coef:+.4f}, "
                                      f"IG {r.integrated_gradients:+.4f}")
        if self.latents is not None:
            about = s["latents"]
            if about.get("spearman_grad_x_act") is not None:
                lines.append(f"latents: rank correlation of gradient x activation with the exact switch-off effect "
                             f"over {about['n_checked']} latents: {about['spearman_grad_x_act']:.3f}")
            lines.append("top latents, by |gradient x activation|:")
            lines += _top_lines(self.latents, self.latent_lens, "latent", "grad_x_act", top, "decoder",
                                lambda r: f"{r.address:<10} grad x act {r.grad_x_act:+.4f}")
        return "\n".join(lines)


def _top_lines(table: pd.DataFrame, lens: pd.DataFrame, index: str, score: str, top: int, written: str,
               head) -> list[str]:
    """`to_text`'s lines of the `top` rows of `table` by |score|: head(row), the exact switch-off effect where
    checked, and the tokens the row's `written` gradient writes where the lens read it (rows matched by layer and
    `index`)."""
    order = table.reindex(table[score].abs().sort_values(ascending=False).index).head(top)
    tokens_of = {(r.layer, getattr(r, index)): r.tokens for r in lens.itertuples()}
    lines = []
    for r in order.itertuples():
        exact = "" if np.isnan(r.exact_off_effect) else f", off exactly {r.exact_off_effect:+.4f}"
        tokens = tokens_of.get((r.layer, getattr(r, index)))
        lines.append(f"  {head(r)}{exact}"
                     + (f"; {written} gradient writes {', '.join(repr(t) for t in tokens[:5])}" if tokens else ""))
    return lines


@torch.no_grad()
def _lens_rows(loaded: LoadedModel, chosen: Sequence[tuple[int, int, torch.Tensor]], target: Target,
               options: AttributeOptions, index: str) -> pd.DataFrame:
    """The vocabulary projection (identity, as values are read) of each chosen (layer, index, gradient of its value):
    the tokens a gradient step on the value would write more of (ascent for a token target, descent for the loss)."""
    view = loaded.view
    sign = -1.0 if target.token is None else 1.0
    rows = []
    for layer, i, grad in chosen:
        z = sign * (view.unembedding.float() @ grad.float())
        top = torch.topk(z, min(options.lens_tokens, z.numel())).indices.tolist()
        rows.append({"layer": layer, index: i, "value_grad_norm": float(grad.norm()),
                     "token_ids": top, "tokens": list(loaded.tokenizer.token_strings(top))})
    return pd.DataFrame(rows, columns=["layer", index, "value_grad_norm", "token_ids", "tokens"])


def _lens(loaded: LoadedModel, sums: Sums, target: Target, options: AttributeOptions) -> pd.DataFrame:
    d_m = loaded.view.d_m
    order = np.argsort(-np.abs(sums.grad_x_coef).reshape(-1), kind="stable")[: options.lens_top]
    chosen = [(int(i) // d_m, int(i) % d_m, sums.value_grads[int(i) // d_m][int(i) % d_m]) for i in order]
    return _lens_rows(loaded, chosen, target, options, "key")


def _latent_table(latents: Latents, sums: Sums) -> pd.DataFrame:
    """One row per latent of every dictionary layer: layer, latent, address, grad_x_act, exact_off_effect (NaN)."""
    parts = []
    for layer in latents.layers:
        n = latents.size(layer)
        parts.append(pd.DataFrame({"layer": layer, "latent": np.arange(n),
                                   "address": [str(latents.ref(layer, j)) for j in range(n)],
                                   "grad_x_act": sums.latent_grad_x_act[layer], "exact_off_effect": np.nan}))
    return pd.concat(parts, ignore_index=True)


def attribute(loaded: LoadedModel, examples_factory, target: Target, options: AttributeOptions = AttributeOptions(),
              progress: bool = False, total: int | None = None, corpus: dict | None = None,
              latents: Latents | None = None) -> Attribution:
    """Attribute `target` to every memory over a corpus, and with `latents` (a dictionary's, of this model) to
    every latent too, in the same pass.

    Args:
        examples_factory: called once per pass, returns the corpus's examples (objects with ``token_ids``); the
            switch-off check reads the corpus a second time.
        total: the number of examples, for the progress bars (None: unknown).
        latents: attached to the model for the switch-off check of latents, and detached again after.
    """
    view = loaded.view
    if view.encoder:
        raise FfkvError("attribution reads a causal LM's next-token predictions; this model is a masked-LM encoder")
    options.validate()
    if target.token is not None and not 0 <= target.token < view.vocab_size:
        raise FfkvError(f"token id {target.token} does not exist: ids are 0..{view.vocab_size - 1}")
    if latents is not None and latents.view is not view:
        raise FfkvError("the latents given belong to another model's view: open them on this model")
    sums = attribution_pass(loaded, examples_factory(), target, options, progress, total, latents)
    L, d_m = view.n_layers, view.d_m
    table = pd.DataFrame({"layer": np.repeat(np.arange(L), d_m), "key": np.tile(np.arange(d_m), L),
                          "grad_x_coef": sums.grad_x_coef.reshape(-1),
                          "integrated_gradients": sums.integrated.reshape(-1) if options.steps else np.nan,
                          "exact_off_effect": np.nan})
    summary = {"target_name": target.name, "target": asdict(target), "options": asdict(options),
               "model": loaded.model_id, "corpus": corpus or {}, "n_examples": sums.n_examples,
               "n_positions": sums.n_positions, "target_value": sums.target, "steps": options.steps,
               "layers": "layer counts from 0 in the tables; the command line counts layers from 1"}
    if options.steps:
        whole = sums.target - sums.layer_off                       # per layer, T − T(layer off)
        gap = np.abs(sums.integrated.sum(1) - whole) / np.maximum(np.abs(whole), 1e-12)
        summary["completeness"] = [{"layer": int(i), "sum_integrated": float(sums.integrated[i].sum()),
                                    "layer_off_effect": float(whole[i])} for i in range(L)]
        summary["completeness_max_relative_error"] = float(gap.max())
    latent_table = _latent_table(latents, sums) if latents is not None else None
    checks: list[Intervention] = []
    if options.check:
        memories = checked_memories(sums.grad_x_coef, options.check, options.seed)
        checks += [Intervention(layer, key, "off") for layer, key in memories]
    if options.check and latent_table is not None:
        scores = latent_table.grad_x_act.to_numpy()[None, :]
        picked = [i for _, i in checked_memories(scores, options.check, options.seed)]
        kinds = {layer: latents.dictionaries[layer].kind for layer in latents.layers}
        checks += [Intervention(int(latent_table.layer[i]), int(latent_table.latent[i]), "off",
                                kind=kinds[int(latent_table.layer[i])]) for i in picked]
    if checks:
        with latents.attached() if latents is not None else nullcontext():
            exact = exact_effects(loaded, examples_factory(), target, checks, options, progress, total)
        n_neurons = len(checks) - (len(picked) if latent_table is not None else 0)
        index = [e.layer * d_m + e.key for e in checks[:n_neurons]]
        table.loc[index, "exact_off_effect"] = exact[:n_neurons]
        summary["n_checked"] = n_neurons
        summary["spearman_grad_x_coef"] = spearman(table.grad_x_coef.to_numpy()[index], exact[:n_neurons])
        summary["spearman_integrated_gradients"] = (spearman(table.integrated_gradients.to_numpy()[index],
                                                             exact[:n_neurons]) if options.steps else None)
        if latent_table is not None:
            latent_table.loc[picked, "exact_off_effect"] = exact[n_neurons:]
    result = Attribution(table, _lens(loaded, sums, target, options), summary)
    if latent_table is not None:
        checked = latent_table.exact_off_effect.notna().to_numpy()
        summary["latents"] = {
            "dictionary": {str(layer): latents.dictionaries[layer].kind for layer in latents.layers},
            "n_latents": len(latent_table), "n_checked": int(checked.sum()),
            "spearman_grad_x_act": spearman(latent_table.grad_x_act.to_numpy()[checked],
                                            latent_table.exact_off_effect.to_numpy()[checked])
            if checked.any() else None,
            "method": "gradient x activation, A_j = sum_p a_j(p) (dec_j . dT/dFF(x)(p)), from the neurons' backward "
                      "pass; integrated gradients: neurons only"}
        order = np.argsort(-np.abs(latent_table.grad_x_act.to_numpy()), kind="stable")[: options.lens_top]
        chosen = [(int(latent_table.layer[i]), int(latent_table.latent[i]),
                   sums.latent_value_grads[int(latent_table.layer[i])][int(latent_table.latent[i])]) for i in order]
        result.latents, result.latent_lens = latent_table, _lens_rows(loaded, chosen, target, options, "latent")
    return result
