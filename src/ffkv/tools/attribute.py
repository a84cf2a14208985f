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

Memory does not grow with the corpus: one batch at a time, running sums of size L × d_m (and the values'
gradients, the size of the FF values).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
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


def attribution_pass(loaded: LoadedModel, examples: Iterable, target: Target, options: AttributeOptions,
                     progress: bool = False, total: int | None = None) -> Sums:
    """One streaming pass: gradient × coefficient, integrated gradients, T, T with each layer off, and the
    values' gradients by the outer-product identity."""
    view = loaded.view
    L, d_m = view.n_layers, view.d_m
    sums = Sums(np.zeros((L, d_m)), np.zeros((L, d_m)),
                [torch.zeros(d_m, view.d_model, device=view.device) for _ in range(L)], layer_off=np.zeros(L))
    ones = torch.ones(d_m, device=view.device)
    bar = progress_bar(progress, total, "attribute", "ex")
    try:
        for n, ids, mask in _batches(loaded, examples, options.batch_size):
            gates = {layer: ones.clone().requires_grad_(True) for layer in range(L)}
            with torch.enable_grad(), gate_coefficients(view, gates), \
                    view.capture(("coefficients", "ff_out")) as cap:
                value = target_value(_logits(loaded, ids, mask), ids, mask, target)
                for t in cap["ff_out"].values():
                    t.retain_grad()
                value.backward()
            sums.target += float(value.detach())
            for layer in range(L):
                sums.grad_x_coef[layer] += gates[layer].grad.double().cpu().numpy()
                sums.value_grads[layer] += value_gradient(cap["coefficients"][layer].detach(),
                                                          cap["ff_out"][layer].grad)
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
def exact_effects(loaded: LoadedModel, examples: Iterable, target: Target, memories: Sequence[tuple[int, int]],
                  options: AttributeOptions, progress: bool = False, total: int | None = None) -> np.ndarray:
    """T − T(m_i = 0 at every position), summed over the corpus, for each (layer, key): the intervene path."""
    effects = np.zeros(len(memories))
    bar = progress_bar(progress, total, "switch-off check", "ex")
    try:
        for n, ids, mask in _batches(loaded, examples, options.batch_size):
            full = float(target_value(_logits(loaded, ids, mask), ids, mask, target))
            for j, (layer, key) in enumerate(memories):
                with intervene(loaded.view, [Intervention(layer, key, "off")]):
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
    the rank correlations."""

    memories: pd.DataFrame
    lens: pd.DataFrame
    summary: dict

    def write(self, out: str | Path) -> list[Path]:
        """OUT/attribute_memories.parquet, OUT/attribute_lens.parquet and OUT/attribute.json, atomically."""
        out = Path(out)
        paths = []
        for name, table in (("memories", self.memories), ("lens", self.lens)):
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
            lines.append(f"rank correlation with the exact switch-off effect over {s['n_checked']} memories: "
                         f"gradient x coefficient {s['spearman_grad_x_coef']:.3f}, integrated gradients "
                         f"{s['spearman_integrated_gradients']:.3f}")
        if s.get("completeness_max_relative_error") is not None:
            lines.append(f"integrated gradients ({s['steps']} steps): per layer, sum vs T - T(layer off): largest "
                         f"relative gap {s['completeness_max_relative_error']:.2e}")
        lines.append(f"top memories (layers from 1), by |gradient x coefficient|:")
        order = self.memories.reindex(self.memories.grad_x_coef.abs().sort_values(ascending=False).index).head(top)
        lens = {(r.layer, r.key): r.tokens for r in self.lens.itertuples()}
        for r in order.itertuples():
            exact = "" if np.isnan(r.exact_off_effect) else f", off exactly {r.exact_off_effect:+.4f}"
            tokens = lens.get((r.layer, r.key))
            lines.append(f"  {r.layer + 1}:{r.key:<6} grad x coef {r.grad_x_coef:+.4f}, IG {r.integrated_gradients:+.4f}"
                         f"{exact}" + (f"; value gradient writes {', '.join(repr(t) for t in tokens[:5])}" if tokens else ""))
        return "\n".join(lines)


@torch.no_grad()
def _lens(loaded: LoadedModel, sums: Sums, target: Target, options: AttributeOptions) -> pd.DataFrame:
    view = loaded.view
    order = np.argsort(-np.abs(sums.grad_x_coef).reshape(-1), kind="stable")[: options.lens_top]
    sign = -1.0 if target.token is None else 1.0   # descent on the loss, ascent on a token's score
    rows = []
    for i in order:
        layer, key = int(i) // view.d_m, int(i) % view.d_m
        grad = sums.value_grads[layer][key]
        z = sign * (view.unembedding.float() @ grad)
        top = torch.topk(z, min(options.lens_tokens, z.numel())).indices.tolist()
        rows.append({"layer": layer, "key": key, "value_grad_norm": float(grad.norm()),
                     "token_ids": top, "tokens": list(loaded.tokenizer.token_strings(top))})
    return pd.DataFrame(rows, columns=["layer", "key", "value_grad_norm", "token_ids", "tokens"])


def attribute(loaded: LoadedModel, examples_factory, target: Target, options: AttributeOptions = AttributeOptions(),
              progress: bool = False, total: int | None = None, corpus: dict | None = None) -> Attribution:
    """Attribute `target` to every memory over a corpus.

    Args:
        examples_factory: called once per pass, returns the corpus's examples (objects with ``token_ids``); the
            switch-off check reads the corpus a second time.
        total: the number of examples, for the progress bars (None: unknown).
    """
    view = loaded.view
    if view.encoder:
        raise FfkvError("attribution reads a causal LM's next-token predictions; this model is a masked-LM encoder")
    options.validate()
    if target.token is not None and not 0 <= target.token < view.vocab_size:
        raise FfkvError(f"token id {target.token} does not exist: ids are 0..{view.vocab_size - 1}")
    sums = attribution_pass(loaded, examples_factory(), target, options, progress, total)
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
    if options.check:
        memories = checked_memories(sums.grad_x_coef, options.check, options.seed)
        exact = exact_effects(loaded, examples_factory(), target, memories, options, progress, total)
        index = [layer * d_m + key for layer, key in memories]
        table.loc[index, "exact_off_effect"] = exact
        summary["n_checked"] = len(memories)
        summary["spearman_grad_x_coef"] = spearman(table.grad_x_coef.to_numpy()[index], exact)
        summary["spearman_integrated_gradients"] = (spearman(table.integrated_gradients.to_numpy()[index], exact)
                                                    if options.steps else None)
    return Attribution(table, _lens(loaded, sums, target, options), summary)
