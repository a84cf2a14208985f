"""Vocabulary classes of memories from their weights alone (beyond the paper: Gurnee et al. 2024).

For each memory i of layer l, with value v_i (its w_out):

- **vocabulary moments**: the mean, variance, skew and raw kurtosis (3 for a normal distribution) over the
  vocabulary of cos(v_i, u_j), u_j the unembedding rows prepared as TransformerLens prepares W_U, which
  Gurnee et al. used: the final normalization's scale folded in (u_j ⊙ γ, LayerNorm and RMSNorm) and centred
  over the vocabulary (a logit shift shared by every token changes no probability);
- **class**: ``prediction`` (kurtosis > 10 and skew > 0: a few tokens pushed up), ``suppression`` (kurtosis > 10
  and skew < 0: a few tokens pushed down), ``partition`` (neither, and the variance above the 99th percentile
  of the layer's random mixtures' (the null, below): the vocabulary split in two), else ``none``. The first two are Gurnee et
  al.'s thresholds; theirs for partition is qualitative, so ffkv's null sets it;
- **weights**: ‖k_i‖, ‖v_i‖, cos(k_i, v_i) and, for a gated FF (k_i its gate row), cos(up_i, v_i);
- **null-space share**: the share of ‖v_i‖² in the span of the k = max(1, round(d/100)) right singular directions
  of the prepared unembedding with the smallest singular values, the statistic of Stolfo et al. 2024's entropy
  neurons (a random direction's expected share: k/d). Entropy neurons also need their total effect through the
  final normalization measured on text, far above the direct one: `ffkv.experiments.confidence_neurons` measures
  it, with the token-frequency and GLU classes.

The null: `N_CONTROL` random directions per layer, each a seeded random mixture of the layer's values (Gaussian
weights, so with the second moment of the values: a trained layer's values crowd into a few directions of the
residual space, which alone raises the variance of their cosines, and an isotropic direction would not share it)
scaled to the norm of a random value, through the same statistics; each class's share among them stands beside
the memories' share, with 95% Wilson intervals. The cosines are computed for blocks of memories at a time
(`BLOCK_ELEMENTS` cosines), so memory stays bounded whatever the vocabulary.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import torch

from ffkv.allocator import release
from ffkv.experiments import common
from ffkv.experiments.common import RunContext, progress_bar, sample_size_warnings, share_with_interval
from ffkv.experiments.figures import kinds_beside, share_curves
from ffkv.experiments.registry import Encoder, Experiment, Figures, Finding, KeyColumn, Result
from ffkv.memories.controls import layer_generator
from ffkv.memories.sets import MemorySet, Neurons
from ffkv.memories.view import MemoryView
from ffkv.presentation.findings import layer_ends, pct, share_ci

NAME = "vocabulary_classes"
#: Gurnee et al. 2024's cut-off: a memory whose cosines with the vocabulary have a raw kurtosis above it is a
#: prediction (skew > 0) or suppression (skew < 0) memory.
KURTOSIS = 10.0
#: The null's variance quantile above which a memory of neither kind is a partition memory.
PARTITION_QUANTILE = 0.99
#: Random directions per layer: the null of every class share.
N_CONTROL = 256
#: Share of d_model taken as the unembedding's null space (Stolfo et al. 2024: about 1%).
NULL_SPACE_SHARE = 0.01
#: Cosines computed at once (memories x vocabulary), so that memory stays bounded.
BLOCK_ELEMENTS = 2**24
CLASSES = ("prediction", "suppression", "partition", "none")


@torch.no_grad()
def prepared_unembedding(view: MemoryView) -> torch.Tensor:
    """The unembedding rows (|V|, d) in float32 on the model's device: the final normalization's scale folded
    in, centred over the vocabulary, each row then of unit length (rows of zero length stay zero)."""
    u = view.unembedding.detach().float()
    norm = view.arch.final_norm(view.model)
    gamma = getattr(norm, "weight", None)
    if isinstance(gamma, torch.Tensor) and gamma.shape == (u.shape[1],):
        u = u * gamma.detach().float()
    u = u - u.double().mean(dim=0, keepdim=True).float()
    return u / u.norm(dim=1, keepdim=True).clamp_min(1e-30)


@torch.no_grad()
def moments(directions: torch.Tensor, units: torch.Tensor) -> np.ndarray:
    """(n, 4): the mean, variance, skew and raw kurtosis over the vocabulary of cos(direction, u_j), for each of
    the n directions (rows), `units` the prepared unembedding (`prepared_unembedding`). The cosines in float32 on
    the unembedding's device, a block of directions at a time; their moments in float64."""
    directions = directions.detach().to(units.device, torch.float32)
    directions = directions / directions.norm(dim=1, keepdim=True).clamp_min(1e-30)
    rows = max(1, BLOCK_ELEMENTS // units.shape[0])
    out = []
    for block in directions.split(rows):
        cos = (block @ units.T).double()                          # (rows, |V|)
        mean = cos.mean(dim=1, keepdim=True)
        centred = cos - mean
        var = centred.pow(2).mean(dim=1)
        sd = var.sqrt().clamp_min(1e-30)
        skew = centred.pow(3).mean(dim=1) / sd**3
        kurtosis = centred.pow(4).mean(dim=1) / sd**4
        out.append(torch.stack([mean[:, 0], var, skew, kurtosis], dim=1).cpu())
    release()  # the blocks' |V|-wide cosines, freed (`ffkv.allocator`)
    return torch.cat(out).numpy()


@torch.no_grad()
def null_space(units: torch.Tensor) -> torch.Tensor:
    """(k, d) float64 on the CPU: the right singular directions of the prepared unembedding with the k smallest
    singular values, k = max(1, round(d · NULL_SPACE_SHARE)); the eigenvectors of its d x d Gram matrix (summed in
    float64 a block of rows at a time), so no |V| x d decomposition is made."""
    d = units.shape[1]
    k = max(1, round(d * NULL_SPACE_SHARE))
    gram = torch.zeros(d, d, dtype=torch.float64)
    for block in units.split(max(1, BLOCK_ELEMENTS // d)):
        b = block.double()
        gram += (b.T @ b).cpu()
    _, vectors = torch.linalg.eigh(gram)                         # eigenvalues in ascending order
    return vectors[:, :k].T.contiguous()


def null_space_share(directions: torch.Tensor, basis: torch.Tensor) -> np.ndarray:
    """‖P v‖² / ‖v‖² for each row v of `directions`, P the projection on the rows of `basis` (orthonormal)."""
    v = directions.detach().double().cpu()
    return ((v @ basis.T).pow(2).sum(dim=1) / v.pow(2).sum(dim=1).clamp_min(1e-300)).numpy()


def classify(stats: np.ndarray, partition_variance: float) -> np.ndarray:
    """Each row's class (`CLASSES`) from its moments (`moments`) and the layer's partition cut-off."""
    _, var, skew, kurtosis = stats.T
    return np.select([(kurtosis > KURTOSIS) & (skew > 0), (kurtosis > KURTOSIS) & (skew < 0),
                      var > partition_variance], list(CLASSES[:3]), default="none")


def random_directions(values: torch.Tensor, layer: int, n: int, seed: int) -> torch.Tensor:
    """n seeded random mixtures of the layer's values, Σ_i a_i v_i with a_i ~ N(0, 1): directions with the second
    moment of the layer's values (the same anisotropy in the residual space, none of one value's own structure),
    each scaled to the norm of a random value of the layer."""
    gen = layer_generator(seed, layer, salt=29)
    values = values.detach().double().cpu()
    norms = values.norm(dim=1)[torch.randint(0, values.shape[0], (n,), generator=gen)]
    mixed = torch.randn(n, values.shape[0], generator=gen, dtype=torch.float64) @ values
    return mixed / mixed.norm(dim=1, keepdim=True).clamp_min(1e-300) * norms[:, None]


def _cos_rows(a: torch.Tensor, b: torch.Tensor) -> np.ndarray:
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return (torch.nn.functional.cosine_similarity(a, b, dim=1)).numpy()


def value_classes(view: MemoryView, seed: int = 0, n_control: int = N_CONTROL, progress: bool = False,
                  memories: MemorySet | None = None) -> dict[str, pd.DataFrame]:
    """The per-key table (``keys``) and the per-layer table (``layers``) of the module docstring, for `memories`
    (default the model's neurons; a dictionary's `Latents`: its decoder rows and encoder rows, on its layers)."""
    memories = memories or Neurons(view)
    units = prepared_unembedding(view)
    basis = null_space(units)
    per_key, per_layer = [], []
    bar = progress_bar(progress, len(memories.layers), NAME, "layer")
    for layer in memories.layers:
        values, keys = memories.values(layer), memories.keys(layer)
        stats = moments(values, units)
        control_dirs = random_directions(values, layer, n_control, seed)
        control = moments(control_dirs, units)
        cut = float(np.quantile(control[:, 1], PARTITION_QUANTILE))
        kinds, control_kinds = classify(stats, cut), classify(control, cut)
        up = view.up(layer) if isinstance(memories, Neurons) else None
        table = pd.DataFrame({
            "layer": layer, "key": np.arange(len(stats)), "class": kinds,
            "vocab_mean": stats[:, 0], "vocab_var": stats[:, 1], "vocab_skew": stats[:, 2],
            "vocab_kurtosis": stats[:, 3], "key_norm": keys.detach().double().norm(dim=1).cpu().numpy(),
            "value_norm": values.detach().double().norm(dim=1).cpu().numpy(),
            "cos_key_value": _cos_rows(keys, values),
            "cos_up_value": _cos_rows(up, values) if up is not None else np.full(len(stats), np.nan),
            "null_space_share": null_space_share(values, basis)})
        per_key.append(table)
        row = {"layer": layer, "n_keys": len(stats), "n_control": n_control, "partition_variance": cut}
        for kind in CLASSES[:3]:
            row.update(share_with_interval(kinds == kind, f"{kind}_share"))
            row.update(share_with_interval(control_kinds == kind, f"{kind}_share_control"))
        row["null_space_share_mean"] = float(table["null_space_share"].mean())
        row["null_space_share_mean_control"] = float(null_space_share(control_dirs, basis).mean())
        row["null_space_share_expected"] = basis.shape[0] / units.shape[1]
        per_layer.append(row)
        bar.update(1)
    bar.close()
    return {"keys": pd.concat(per_key, ignore_index=True), "layers": pd.DataFrame(per_layer)}


def draw(result: Result) -> Figures:
    """Each class's share per layer with its 95% interval, the null's share dashed beside it; with latents, their
    prediction share beside the neurons', each with its own null."""
    figures = {NAME: share_curves(result.tables[NAME], [(f"{kind}_share", kind, color) for kind, color in
                                                        zip(CLASSES[:3], ("tab:blue", "tab:red", "tab:green"))],
                                  "Vocabulary classes of the values (kurtosis > 10: prediction, suppression)",
                                  null="random mixtures of values")}
    if f"{NAME}_latents" in result.tables:
        table = result.tables[f"{NAME}_latents"].merge(
            result.tables[NAME][["layer", "prediction_share_control"]].rename(
                columns={"prediction_share_control": "prediction_share_neurons_control"}), on="layer")
        figures[f"{NAME}_latents"] = kinds_beside(
            table, (("neurons", "prediction_share_neurons", "prediction_share_neurons_control", None),
                    ("latents", "prediction_share", "prediction_share_control", None)),
            "% prediction memories\n(kurtosis > 10, skew > 0)",
            "Prediction values: neurons vs. the dictionary's latents, each beside random mixtures of its values")
    return figures


def compute(ctx: RunContext, options=None) -> Result:
    """metrics/vocabulary_classes (per layer) and vocabulary_classes_keys, from the weights alone."""
    found = value_classes(ctx.view, ctx.seed, progress=ctx.progress)
    ctx.once((NAME, "keys"), lambda: found["keys"])  # for the steps that read it in this call, on every rank
    meta = {"statistic": "moments over the vocabulary of cos(v_i, u_j), u_j the unembedding rows with the final "
                         "normalization's scale folded in and centred over the vocabulary (Gurnee et al. 2024)",
            "rule": f"prediction: kurtosis > {KURTOSIS:g} and skew > 0; suppression: kurtosis > {KURTOSIS:g} and "
                    f"skew < 0; partition: neither, variance above the {PARTITION_QUANTILE:.0%} quantile of "
                    f"{N_CONTROL} random mixtures of the layer's values",
            "control": f"{N_CONTROL} random mixtures of the layer's values per layer (Gaussian weights), norms of "
                       f"random values, seed {ctx.seed}",
            "warnings": sample_size_warnings(NAME, ctx.view.d_m, "memories")}
    result = Result(ctx.view.n_layers, record=dict(meta))
    result.add(NAME, found["layers"], **meta)
    result.add(f"{NAME}_keys", found["keys"], **meta)
    latents, unread = ctx.latents_for(f"{NAME}_latents")  # the decoder rows by the same rule, beside the neurons
    if unread:
        result.meta[NAME] = {**meta, "warnings": [*meta["warnings"], *unread]}
    if latents is not None:
        found_latents = value_classes(ctx.view, ctx.seed, memories=latents)
        meta_lat = {**meta, "memories": "the decoder rows (values) and encoder rows (keys) of the dictionary the "
                    "run was indexed with, only the layers it covers; the null: random mixtures of its decoder "
                    "rows", "neurons": "*_neurons: the same layer's neurons (metrics/vocabulary_classes); "
                    "*_minus_neurons: latents minus neurons, Newcombe's 95% interval",
                    "warnings": []}
        result.add(f"{NAME}_latents", beside_neurons(found_latents["layers"], found_latents["keys"], found["keys"]),
                   **meta_lat)
        result.add(f"{NAME}_latents_keys", found_latents["keys"], **meta_lat)
    return result


def beside_neurons(latent_layers: pd.DataFrame, latent_keys: pd.DataFrame, neuron_keys: pd.DataFrame
                   ) -> pd.DataFrame:
    """`latent_layers` with, per layer and class, the share among the same layer's neurons (CLASS_share_neurons)
    and the latents' minus the neurons' (CLASS_share_minus_neurons: Newcombe's 95% interval)."""
    rows = []
    for layer in latent_layers["layer"]:
        mine = latent_keys.loc[latent_keys["layer"] == layer, "class"].to_numpy()
        theirs = neuron_keys.loc[neuron_keys["layer"] == layer, "class"].to_numpy()
        row = {"layer": int(layer)}
        for kind in CLASSES[:3]:
            row.update(common.beside_neurons(mine == kind, theirs == kind, f"{kind}_share"))
        rows.append(row)
    return latent_layers.merge(pd.DataFrame(rows), on="layer")


FINDING = Finding("Beyond the paper", (
    "Gurnee et al. 2024 (GPT-2): prediction neurons (raw kurtosis of the value's cosines "
    "with the vocabulary above 10, positive skew) become common in the later half of the layers, and "
    "suppression neurons (negative skew) in the last layers, after the prediction neurons."))
FINDING_LATENTS = Finding("Beyond the paper", (
    "The same classes for the decoder rows of a sparse dictionary of the layer, beside the neurons of that layer: "
    "do the latents' values predict (or suppress) a few tokens more often than the neurons' do?"))
FINDINGS = {NAME: FINDING, f"{NAME}_keys": FINDING, f"{NAME}_latents": FINDING_LATENTS,
            f"{NAME}_latents_keys": FINDING_LATENTS}


def reading(name: str, table: pd.DataFrame) -> str | None:
    """The classes on this model: the prediction and suppression shares in the first and last layers against
    the null's. Layers count from 1."""
    if name == f"{NAME}_latents" and "prediction_share_neurons" in table:
        return " ".join(
            f"Layer {int(row.layer) + 1}: " + "; ".join(
                f"{kind} {share_ci(getattr(row, f'{kind}_share'), row.n_keys)} of latents (random mixtures of their "
                f"values {pct(getattr(row, f'{kind}_share_control'))}) against "
                f"{pct(getattr(row, f'{kind}_share_neurons'))} of neurons, difference "
                f"[{100 * getattr(row, f'{kind}_share_minus_neurons_ci_low'):+.1f}, "
                f"{100 * getattr(row, f'{kind}_share_minus_neurons_ci_high'):+.1f}] points"
                for kind in CLASSES[:3]) + "."
            for row in table.itertuples(index=False))
    if name != NAME or "prediction_share" not in table:
        return None
    t, first, last, n_first, n_last = layer_ends(table)
    return (f"In this model {share_ci(first.prediction_share, first.n_keys)} of the memories of {n_first} are "
            f"prediction memories and {share_ci(first.suppression_share, first.n_keys)} suppression memories; in "
            f"{n_last}: {share_ci(last.prediction_share, last.n_keys)} and "
            f"{share_ci(last.suppression_share, last.n_keys)}, against {pct(last.prediction_share_control)} and "
            f"{pct(last.suppression_share_control)} of random mixtures of the layer's values (n: memories per layer).")


EXPERIMENT = Experiment(
    name=NAME, title="Vocabulary classes of the values: prediction, suppression, partition (beyond the paper)",
    section="beyond the paper: Gurnee et al. 2024, Stolfo et al. 2024", order=6.5, compute=compute, draw=draw,
    encoder=Encoder(False, "vocabulary classes (beyond the paper)", "not computed: an encoder's values reach the vocabulary "
                    "through the MLM head's dense transform, which the cosines with its decoder rows leave out"),
    latents=("vocabulary_classes_latents, vocabulary_classes_latents_keys: the decoder rows' classes, with random "
             "mixtures of the dictionary's own rows as the null, beside the layer's neurons"),
    findings=FINDINGS, reading=reading, how=("rule", "control"),
    key_columns=(KeyColumn(f"{NAME}_keys", "class", "vocab class", "vocab class"),),
    module=__name__)
