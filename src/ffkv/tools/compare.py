"""Universality of memories across two models (beyond the paper: Gurnee et al. 2024, "Universal Neurons").

Two runs of two models on the same corpus, read with the same tokenizer: both models read the same examples, and at
every token position the coefficients m^A (d_m^A) and m^B (d_m^B) of each layer are reduced at once into sums,
squares and cross-products (float64), so memory is a few d_m x d_m matrices per layer, whatever the corpus length.
Per layer l (the same layer index in both models):

- corr(i, j): the Pearson correlation over positions of m^A_i and m^B_j, for every pair;
- **best match** of key i of A: argmax_j corr(i, j), exact (every pair is computed), and its correlation;
- **rotation baseline**: the same maximum against m^B·R, R a seeded random orthogonal rotation of B's key space
  (Gurnee et al.'s baseline: the same activations with no privileged basis), read from the same sums
  (cov(m^A, m^B R) = cov(m^A, m^B)·R and var((m^B R)_j) = (Rᵀ·cov(m^B)·R)_jj);
- **excess** = best correlation − the rotation's best, and per layer the share of keys with excess above
  `EXCESS_CUT` (Gurnee et al.: 4.16% of GPT-2 small's neurons across seeds), with its 95% Wilson interval.

A key that never varies (constant coefficient) has no correlation: NaN, left out of the shares' n.

**Latents** (`compare_sets`, `ffkv compare RUN_A RUN_B --of latents --against neurons`): either side may be a
sparse dictionary's latents (`ffkv.memories.sets`) instead of the model's neurons, on the layers both sides have:
a dictionary's latents against the same model's neurons (one run, one pass), or two dictionaries of one model
against each other (two runs of that model on one corpus). The activations a_j take the place of m_i; the
rotation baseline rotates B's space (its d_m or its n_latents dimensions) the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from ffkv.batching import row_batches
from ffkv.errors import FfkvError
from ffkv.experiments.common import progress_bar
from ffkv.memories.sets import Latents, MemorySet, Neurons
from ffkv.models.loading import LoadedModel
from ffkv.presentation.findings import wilson_interval
from ffkv.store import atomic
from ffkv.store.manifest import Manifest
from ffkv.store.run import SOURCES, RunDir
from ffkv.tools.matches import EXCESS_CUT, FOLDER

#: Examples read by default (from run A's examples table, in order).
MAX_EXAMPLES = 2000


@dataclass
class PairSums:
    """Streaming sums of one layer's coefficient pairs: n positions, Σa, Σb, Σa², Σ a bᵀ and Σ b bᵀ (float64)."""

    n: int
    a: torch.Tensor
    b: torch.Tensor
    aa: torch.Tensor
    ab: torch.Tensor
    bb: torch.Tensor

    @classmethod
    def empty(cls, d_a: int, d_b: int, device: torch.device | str = "cpu") -> "PairSums":
        z = lambda *s: torch.zeros(*s, dtype=torch.float64, device=device)  # noqa: E731
        return cls(0, z(d_a), z(d_b), z(d_a), z(d_a, d_b), z(d_b, d_b))

    def add(self, a: torch.Tensor, b: torch.Tensor) -> None:
        """Add (n, d_a) and (n, d_b) coefficients of the same n positions. Centred on the running mean first would
        be steadier; a float64 sum over a corpus of coefficients of order 1 loses nothing that matters here."""
        a, b = a.double(), b.double()
        self.n += a.shape[0]
        self.a += a.sum(0)
        self.b += b.sum(0)
        self.aa += a.pow(2).sum(0)
        self.ab += a.T @ b
        self.bb += b.T @ b

    def covariances(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(var(a) (d_a,), cov(a, b) (d_a, d_b), cov(b) (d_b, d_b)), population covariances."""
        n = max(self.n, 1)
        mean_a, mean_b = self.a / n, self.b / n
        return (self.aa / n - mean_a**2, self.ab / n - torch.outer(mean_a, mean_b),
                self.bb / n - torch.outer(mean_b, mean_b))


def _correlation(var_a: torch.Tensor, cov: torch.Tensor, var_b: torch.Tensor) -> torch.Tensor:
    sd_a, sd_b = var_a.clamp_min(0).sqrt(), var_b.clamp_min(0).sqrt()
    corr = cov / torch.outer(sd_a, sd_b)
    corr[(sd_a <= 1e-12)[:, None] | (sd_b <= 1e-12)[None, :]] = float("nan")
    return corr


def random_rotation(d: int, seed: int, layer: int) -> torch.Tensor:
    """A seeded random orthogonal (d, d) matrix, Haar-distributed (QR of a Gaussian matrix, signs fixed)."""
    gen = torch.Generator().manual_seed(int(seed) * 1_000_003 + int(layer))
    q, r = torch.linalg.qr(torch.randn(d, d, generator=gen, dtype=torch.float64))
    return q * torch.sign(torch.diagonal(r))[None, :]


def layer_table(sums: PairSums, layer: int, seed: int = 0, sets: tuple[MemorySet, MemorySet] | None = None
                ) -> pd.DataFrame:
    """One row per key of A: its best match in B, the correlation, the rotation baseline's best, the excess."""
    var_a, cov, cov_b = (t.cpu() for t in sums.covariances())
    corr = _correlation(var_a, cov, torch.diagonal(cov_b))
    rotation = random_rotation(cov_b.shape[0], seed, layer)
    rotated = _correlation(var_a, cov @ rotation, torch.diagonal(rotation.T @ cov_b @ rotation))
    best = torch.nan_to_num(corr, nan=-np.inf).max(dim=1)
    baseline = torch.nan_to_num(rotated, nan=-np.inf).max(dim=1).values
    dead = ~torch.isfinite(best.values) | ~torch.isfinite(baseline)
    value = torch.where(dead, torch.full_like(best.values, float("nan")), best.values)
    base = torch.where(dead, torch.full_like(baseline, float("nan")), baseline)
    table = pd.DataFrame({"layer": layer, "key": np.arange(corr.shape[0]),
                          "best_match": np.where(dead.numpy(), -1, best.indices.numpy()),
                          "correlation": value.numpy(), "rotation_correlation": base.numpy(),
                          "excess": (value - base).numpy(), "n_positions": sums.n})
    if sets is not None and any(isinstance(side, Latents) for side in sets):  # say what key and best_match index
        table["address"] = [str(sets[0].ref(layer, i)) for i in range(len(table))]
        table["match_address"] = [str(sets[1].ref(layer, j)) if j >= 0 else "" for j in table["best_match"]]
    return table


def summary(keys: pd.DataFrame) -> pd.DataFrame:
    """Per layer: keys compared, mean best and rotation correlations, the share with excess above `EXCESS_CUT`."""
    rows = []
    for layer, own in keys.groupby("layer", sort=True):
        live = own[own["excess"].notna()]
        k, n = int((live["excess"] > EXCESS_CUT).sum()), len(live)
        low, high = (float(np.squeeze(x)) for x in wilson_interval(k, n))
        rows.append({"layer": int(layer), "n_keys": n, "n_constant": int(len(own) - n),
                     "n_positions": int(own["n_positions"].iloc[0]),
                     "mean_correlation": float(live["correlation"].mean()) if n else float("nan"),
                     "mean_rotation_correlation": float(live["rotation_correlation"].mean()) if n else float("nan"),
                     "universal_share": k / n if n else float("nan"), "universal_share_ci_low": low,
                     "universal_share_ci_high": high})
    return pd.DataFrame(rows)


def check_comparable(a: Manifest, b: Manifest, path_a: Path, path_b: Path) -> None:
    """Refuse, with one line, two runs that did not read the same corpus the same way or whose layers differ."""
    def corpus(m: Manifest) -> dict:
        return {k: v for k, v in m.identity.corpus.items() if k != "source"}

    if a.identity.corpus_fingerprint != b.identity.corpus_fingerprint or corpus(a) != corpus(b):
        raise FfkvError(f"{path_a} and {path_b} were indexed on different corpora (or corpus options); compare reads "
                        "two models on the same corpus: index both on one corpus with the same options")
    if a.model.encoder or b.model.encoder:
        raise FfkvError("compare reads causal LMs; an encoder's run is refused")
    if a.model.n_layers != b.model.n_layers:
        raise FfkvError(f"{path_a} has {a.model.n_layers} layers and {path_b} {b.model.n_layers}; compare pairs "
                        "layer l of one with layer l of the other")


def _examples(run: RunDir, limit: int) -> list[tuple[int, np.ndarray]]:
    """The first `limit` (example id, token ids) rows of a run's examples table, read a record batch at a time."""
    out: list[tuple[int, np.ndarray]] = []
    for batch in pq.ParquetFile(run.table("examples")).iter_batches(columns=["example_id", "token_ids"]):
        for i, t in zip(batch.column(0).to_pylist(), batch.column(1).to_pylist()):
            out.append((int(i), np.asarray(t, dtype=np.int64)))
            if len(out) >= limit:
                return out
    return out


@torch.no_grad()
def compare(loaded_a: LoadedModel, loaded_b: LoadedModel, rows: list[tuple[int, np.ndarray]], seed: int = 0,
            progress: bool = False) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(keys, layers) tables of the module docstring for two loaded models' neurons on the same token rows."""
    if loaded_a.view.n_layers != loaded_b.view.n_layers:
        raise FfkvError(f"the models have {loaded_a.view.n_layers} and {loaded_b.view.n_layers} layers; compare "
                        "pairs layer l of one with layer l of the other")
    return compare_sets((loaded_a, Neurons(loaded_a.view)), (loaded_b, Neurons(loaded_b.view)), rows, seed, progress)


@torch.no_grad()
def compare_sets(a: tuple[LoadedModel, MemorySet], b: tuple[LoadedModel, MemorySet],
                 rows: list[tuple[int, np.ndarray]], seed: int = 0, progress: bool = False
                 ) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(keys, layers) tables of the module docstring for memory set A against memory set B (each of its model:
    the same model read once, or two), on the same token rows and the layers both sets have."""
    sides = {"a": a, "b": b}
    layers = sorted(set(a[1].layers) & set(b[1].layers))
    if not layers:
        raise FfkvError("the two sets of memories share no layer (a dictionary covers only some layers)")
    device = a[0].view.device
    sums = {layer: PairSums.empty(a[1].size(layer), b[1].size(layer), device) for layer in layers}
    batches = row_batches([(i, t) for i, (_, t) in enumerate(rows)], a[0].tokenizer.pad_id, a[0].special_ids,
                          device, every_rank=True)
    passes = [("a", "b")] if a[0] is b[0] else [("a",), ("b",)]  # one model: one pass reads both sets
    bar = progress_bar(progress, len(rows), "compare", "ex")
    for idx, batch in batches:
        got: dict[str, dict[int, torch.Tensor]] = {}
        for names in passes:
            view = sides[names[0]][0].view
            needs = {sides[n][1].reads(layer) for n in names for layer in layers}
            with view.capture(tuple(sorted(needs)), layers=layers) as captured:
                view.forward(batch.input_ids.to(view.device), batch.attention_mask.to(view.device))
            mask = batch.attention_mask.bool().to(view.device)
            for n in names:
                memories = sides[n][1]
                got[n] = {layer: memories.coefficients(layer, captured[memories.reads(layer)][layer]
                                                       .reshape(*mask.shape, -1))[mask] for layer in layers}
        for layer, s in sums.items():
            s.add(got["a"][layer].to(s.a.device), got["b"][layer].to(s.a.device))
        bar.update(len(idx))
    bar.close()
    keys = pd.concat([layer_table(s, layer, seed, (a[1], b[1])) for layer, s in sums.items()], ignore_index=True)
    return keys, summary(keys)


def compare_runs(run_a: str | Path, run_b: str | Path, out: str | Path | None = None,
                 max_examples: int = MAX_EXAMPLES, seed: int = 0, device: str = "cpu", progress: bool = True,
                 loaded: tuple[LoadedModel, LoadedModel] | None = None, of: str = "neurons",
                 against: str | None = None) -> Path:
    """`ffkv compare RUN_A RUN_B`: both models on run A's first `max_examples` examples; writes keys.parquet and
    layers.parquet (and compare.json, what was compared) atomically to `out` (default RUN_A/compare) and returns
    that folder. The runs must have read the same corpus with the same options, and the same token ids.

    Args:
        of, against: which memories of run A and of run B are compared ("neurons" or "latents": the dictionary the
            run was indexed with; `against` defaults to `of`); with latents on either side the default folder is
            RUN_A/compare_OF_AGAINST. RUN_B may be RUN_A itself when the two sides differ (latents against neurons).
    """
    against = of if against is None else against
    for side in (of, against):
        if side not in SOURCES:
            raise FfkvError(f"compare reads {' or '.join(SOURCES)}, not {str(side)[:40]!r}")
    a, b = RunDir(run_a), RunDir(run_b)
    ma, mb = a.require_complete(), b.require_complete()
    same = a.path.resolve() == b.path.resolve()
    if same and of == against:
        raise FfkvError(f"{a.path} compared with itself, {of} against {of}: name another run, or --against the "
                        "other kind")
    check_comparable(ma, mb, a.path, b.path)
    if not isinstance(max_examples, int) or max_examples < 1:
        raise FfkvError(f"--max-examples must be a positive integer, got {max_examples!r}")
    rows = _examples(a, max_examples)
    if [(i, t.tolist()) for i, t in _examples(b, max_examples)] != [(i, t.tolist()) for i, t in rows]:
        raise FfkvError(f"{a.path} and {b.path} tokenized the corpus differently (different tokenizers); compare "
                        "needs the same token ids in both models")
    if loaded is None:
        from ffkv.models import load_model

        first = load_model(ma.model.id, dtype=ma.model.dtype, device=device)
        loaded = (first, first if same else load_model(mb.model.id, dtype=mb.model.dtype, device=device))

    def memories(side: str, model: LoadedModel, run: RunDir, manifest: Manifest) -> MemorySet:
        if side == "neurons":
            return Neurons(model.view)
        return Latents.of_run(model.view, manifest.index.get("dictionary"), run=run.path)

    if of == against == "neurons":
        keys, layers = compare(loaded[0], loaded[1], rows, seed, progress)
    else:
        keys, layers = compare_sets((loaded[0], memories(of, loaded[0], a, ma)),
                                    (loaded[1], memories(against, loaded[1], b, mb)), rows, seed, progress)
    folder = Path(out) if out is not None else a.path / (FOLDER if of == against == "neurons"
                                                         else f"{FOLDER}_{of}_{against}")
    folder.mkdir(parents=True, exist_ok=True)
    atomic.write_parquet(folder / "keys.parquet", pa.Table.from_pandas(keys, preserve_index=False))
    atomic.write_parquet(folder / "layers.parquet", pa.Table.from_pandas(layers, preserve_index=False))
    atomic.write_json(folder / "compare.json", {
        "run_a": str(a.path.resolve()), "run_b": str(b.path.resolve()), "model_a": ma.model.id,
        "model_b": mb.model.id, "of": of, "against": against, "examples": len(rows), "seed": seed,
        "excess_cut": EXCESS_CUT,
        "statistic": "Pearson correlation over every token position of the examples, every key pair per layer; "
                     "baseline: a seeded random orthogonal rotation of B's key space (Gurnee et al. 2024)"})
    return folder
