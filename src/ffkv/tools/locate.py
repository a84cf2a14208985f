"""`ffkv locate`: causal tracing (Meng et al. 2022, "Locating and Editing Factual Associations in GPT",
Section 2.1), down to single memories.

For a fact (a prompt, its subject, and the answer the prompt should continue with):

1. **Clean run**: p_clean = p(answer | prompt), the answer's first token at the prompt's last position.
2. **Corrupted runs**: Gaussian noise N(0, (ν·σ)²) added to the input embedding of every subject token,
   σ the standard deviation of the input embeddings' entries over the vocabulary (`embedding_std`), ν = 3
   by default; `samples` seeded draws. p_corrupted is the mean over the draws.
3. **Restored runs**: the corrupted runs with one state copied back from the clean run, at one layer l
   and token position t: the hidden state (the block's output), or the FF output or the attention output
   of a window of layers around l (layers max(0, l - w//2) .. min(L, l + ceil(w/2)) - 1, as ROME's
   script). p_restored(l, t) is the mean over the same draws (one noise per draw, shared by every cell).

   Indirect effect IE(l, t) = p_restored(l, t) - p_corrupted; total effect TE = p_clean - p_corrupted.

4. **Memories**: at the FF cell with the largest IE (or the layer and/or position asked for),
   the memories' coefficients are restored one at a time (only m_i at layer l, position t, from the clean
   run: its contribution m_i·v_i): IE_i = p_restored_i - p_corrupted, measured exactly for the
   `candidates` memories whose restoration changes the FF output most (|m_i,clean - m_i,corrupted|·‖v_i‖),
   all of them when `candidates` >= d_m.

5. **Latents** (with a sparse dictionary at that layer, `ffkv.memories.sets.Latents`): at the same cell, one
   latent at a time is restored: the FF output of each corrupted row there becomes FF(x) + (a_j,clean −
   a_j,corrupted)·dec_j (the edit `ffkv.memories.intervene` makes, with the clean row's activation: the
   reconstruction from the restored latent plus the error term), IE_j as above, for the `candidates` latents
   whose restoration changes the FF output most (|a_j,clean − a_j,corrupted|·‖dec_j‖).

Every forward pass runs a batch of one clean row and the corrupted rows of several cells
(`ffkv.memories.patching`): the clean row is what the restores copy from.
"""

from __future__ import annotations

import json
import math
import textwrap
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
import pandas as pd
import pyarrow as pa
import torch

from ffkv.errors import FfkvError
from ffkv.experiments.common import progress_bar
from ffkv.memories.address import edit_text
from ffkv.memories.interventions import Intervention, replace_ff_output
from ffkv.memories.patching import Restore, corrupt_and_restore, embedding_std
from ffkv.memories.sets import Latents
from ffkv.memories.projection import final_logits
from ffkv.models.loading import LoadedModel
from ffkv.store import atomic, untrusted

#: The most bytes a facts file may have (ROME's 1,209 known facts take 250 kB).
MAX_FACTS_BYTES = 64 << 20
#: The restored states, in the order of ROME's figures.
KINDS = ("hidden", "ff_out", "attn_out")
KIND_LABELS = {"hidden": "hidden state (block output)", "ff_out": "FF output", "attn_out": "attention output"}
SHORT_LABELS = {"hidden": "hidden state", "ff_out": "FF output", "attn_out": "attention"}


@dataclass(frozen=True)
class Fact:
    """A prompt, its subject (a substring of the prompt) and, optionally, the answer that continues it
    (None: the model's own top prediction on the clean prompt, as ROME traces)."""

    prompt: str
    subject: str
    answer: str | None = None


@dataclass(frozen=True)
class LocateOptions:
    """How to trace (defaults: ROME's, the window in proportion to the model's depth).

    Attributes:
        samples: corrupted draws averaged per cell.
        noise: the noise's standard deviation in multiples of the embeddings' σ.
        window: layers restored together for FF and attention outputs (None: `default_window`).
        seed: seeds the noise.
        kinds: which states are restored (`KINDS`).
        candidates: memories whose single restoration is measured at the best FF cell.
        top_memories: memories listed (and given to `ffkv intervene`).
        layer, position: the FF cell the memories are traced at (None: the cell, or the layer's or position's
            cell, with the largest FF indirect effect).
        max_rows: batch rows per forward pass (speed and memory only).
    """

    samples: int = 10
    noise: float = 3.0
    window: int | None = None
    seed: int = 0
    kinds: tuple[str, ...] = KINDS
    candidates: int = 256
    top_memories: int = 10
    layer: int | None = None
    position: int | None = None
    max_rows: int = 256

    def validate(self, n_layers: int) -> None:
        if self.samples < 1:
            raise FfkvError(f"samples must be at least 1, got {self.samples}")
        if not (math.isfinite(self.noise) and self.noise > 0):
            raise FfkvError(f"noise must be a positive number of standard deviations, got {self.noise}")
        if self.window is not None and not 1 <= self.window <= n_layers:
            raise FfkvError(f"window must be 1..{n_layers} layers, got {self.window}")
        unknown = [k for k in self.kinds if k not in KINDS]
        if unknown or not self.kinds:
            raise FfkvError(f"unknown state {unknown[0]!r} to restore; choose from {', '.join(KINDS)}"
                            if unknown else "no state to restore")
        if self.candidates < 1 or self.top_memories < 1:
            raise FfkvError("candidates and top memories must be at least 1")
        if self.layer is not None and not 0 <= self.layer < n_layers:
            raise FfkvError(f"layer {self.layer + 1} does not exist: this model has layers 1..{n_layers}")


def default_window(n_layers: int) -> int:
    """ROME's window of 10 layers on GPT-2 XL's 48, in proportion to the depth: round(10·L/48), at least 1."""
    return max(1, round(10 * n_layers / 48))


def window_layers(layer: int, window: int, n_layers: int) -> range:
    """The layers restored together around `layer` (ROME's `trace_important_window`)."""
    return range(max(0, layer - window // 2), min(n_layers, layer - (-window // 2)))


@dataclass
class Tracing:
    """One fact traced. `effects[kind]` is p_restored, (L, T); positions count from 0, layers from 0."""

    fact: Fact
    token_ids: list[int]
    tokens: list[str]
    subject: list[int]
    answer_id: int
    answer_token: str
    p_clean: float
    p_corrupted: float
    noise_std: float
    window: int
    effects: dict[str, np.ndarray]
    cell: tuple[int, int] | None = None         # (layer, position) of the memories' trace
    p_ff_restored: float | None = None          # the whole FF output restored at the cell, that layer alone
    memories: pd.DataFrame = field(default_factory=pd.DataFrame)
    latents: pd.DataFrame = field(default_factory=pd.DataFrame)  # with a dictionary at the cell's layer

    @property
    def total_effect(self) -> float:
        return self.p_clean - self.p_corrupted

    def indirect_effect(self, kind: str) -> np.ndarray:
        return self.effects[kind] - self.p_corrupted


# ------------------------------------------------------------------ inputs
def read_facts(path: str | Path) -> list[Fact]:
    """Facts from a JSONL file: one object per line with ``prompt`` and ``subject``, and optionally the
    answer as ``answer`` (or ``attribute`` / ``target``, as ROME's known-facts files name it)."""
    path = Path(path)
    facts = []
    data = untrusted.read_bytes(path, MAX_FACTS_BYTES, "a facts file (JSON Lines)")
    try:
        lines = data.decode("utf-8").splitlines()
    except UnicodeDecodeError as exc:
        raise FfkvError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start}): not a facts file") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = untrusted.parse_json(line)
        except ValueError as exc:
            raise FfkvError(f"{path}: line {n} is not JSON ({exc})") from None
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or not isinstance(row.get("subject"), str):
            raise FfkvError(f"{path}: line {n} needs string fields 'prompt' and 'subject'")
        answer = next((row[k] for k in ("answer", "attribute", "target") if row.get(k) is not None), None)
        if answer is not None and not isinstance(answer, str):
            raise FfkvError(f"{path}: line {n}: the answer must be a string")
        facts.append(Fact(row["prompt"], row["subject"], answer))
    if not facts:
        raise FfkvError(f"{path} holds no fact (one JSON object per line with 'prompt' and 'subject')")
    return facts


def _encode(loaded: LoadedModel, text: str) -> list[int]:
    return [int(i) for i in loaded.tokenizer.encode(text)]


def subject_positions(loaded: LoadedModel, prompt: str, subject: str) -> list[int]:
    """The token positions of the subject's first occurrence in the prompt (its leading spaces included):
    those of encode(prompt[:end]) beyond encode(prompt[:start]), where both tokenize as a prefix of the prompt."""
    start = prompt.find(subject) if subject else -1
    if start < 0:
        raise FfkvError(f"the subject {subject!r} does not occur in the prompt {prompt!r}")
    end = start + len(subject)
    while start > 0 and prompt[start - 1].isspace():
        start -= 1
    whole, before, through = _encode(loaded, prompt), _encode(loaded, prompt[:start]), _encode(loaded, prompt[:end])
    if whole[:len(through)] != through or through[:len(before)] != before:
        raise FfkvError(f"the subject {subject!r} does not start and end on token boundaries of the prompt "
                        f"{prompt!r} for this tokenizer; give a subject made of whole tokens")
    positions = list(range(len(before), len(through)))
    if not positions:
        raise FfkvError(f"the subject {subject!r} covers no token of the prompt")
    return positions


def answer_token(loaded: LoadedModel, prompt: str, answer: str) -> int:
    """The answer's first token as it continues the prompt (a space put between them when neither has one,
    as ROME does)."""
    if not answer.strip():
        raise FfkvError("the answer is empty")
    sep = "" if prompt[-1:].isspace() or answer[:1].isspace() else " "
    whole, longer = _encode(loaded, prompt), _encode(loaded, prompt + sep + answer)
    special = loaded.special_ids
    if longer[:len(whole)] != whole or len(longer) == len(whole) or longer[len(whole)] in special:
        raise FfkvError(f"the answer {answer!r} does not continue the prompt {prompt!r} on a token boundary")
    return longer[len(whole)]


# ------------------------------------------------------------------ passes
class _Passes:
    """Forward passes of one prompt: a clean row and groups of `samples` corrupted rows, each group with its
    own restores; returns p(answer) per row."""

    def __init__(self, loaded: LoadedModel, ids: list[int], subject: list[int], noise: torch.Tensor, answer: int):
        self.view, self.subject, self.noise, self.answer = loaded.view, subject, noise, answer
        self.ids = torch.tensor([ids], dtype=torch.long, device=self.view.device)

    def run(self, groups: Sequence[Sequence[Restore]], capture_layer: int | None = None,
            captured: str = "coefficients"):
        """p(answer) of each row (1 + len(groups)·samples rows; the groups' restores give rows relative to their
        group); with `capture_layer`, also that layer's `captured` quantity (rows, T, ...)."""
        view, S = self.view, self.noise.shape[0]
        n = 1 + max(1, len(groups)) * S
        noise = torch.cat([torch.zeros_like(self.noise[:1]), self.noise.repeat(max(1, len(groups)), 1, 1)])
        restores = [Restore(r.site, r.layer, 1 + g * S, 1 + (g + 1) * S, r.position, r.feature)
                    for g, group in enumerate(groups) for r in group]
        ids = self.ids.expand(n, -1)
        quantities = ("head_in", "resid_post") + ((captured,) if capture_layer is not None else ())
        with corrupt_and_restore(view, (n, ids.shape[1]), self.subject, noise, restores), \
                view.capture(quantities, layers={view.n_layers - 1} | ({capture_layer} - {None})) as cap:
            view.forward(ids, torch.ones_like(ids), with_head=True)
        head = cap["head_in"].get(-1)
        last = cap["resid_post"][view.n_layers - 1][:, -1] if head is None else None
        logits = final_logits(view, None if head is None else head[:, -1], last)
        p = logits.float().softmax(-1)[:, self.answer].double().cpu()
        m = cap[captured][capture_layer] if capture_layer is not None else None
        if m is not None:
            m = m.view(n, ids.shape[1], -1)
            m = m.float().cpu() if captured == "coefficients" else m
        return p, m

    def group_means(self, groups: Sequence[Sequence[Restore]], max_rows: int) -> tuple[np.ndarray, float]:
        """Per group, the mean p(answer) of its corrupted rows; and the clean row's p(answer)."""
        S = self.noise.shape[0]
        per_pass = max(1, (max_rows - 1) // S)
        means, clean = [], float("nan")
        for start in range(0, len(groups), per_pass):
            p, _ = self.run(groups[start:start + per_pass])
            clean = float(p[0])
            means.extend(float(p[1 + g * S:1 + (g + 1) * S].mean()) for g in range(len(groups[start:start + per_pass])))
        return np.array(means, dtype=np.float64), clean


def _noise(view, subject: list[int], options: LocateOptions, sigma: float, d_embed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(options.seed)
    draw = torch.randn(options.samples, len(subject), d_embed, generator=generator, dtype=torch.float64)
    return (draw * options.noise * sigma).float().to(view.device)


def _embed_width(loaded: LoadedModel) -> int:
    embed = loaded.view.arch.embed(loaded.model)
    with torch.no_grad():
        return int(embed(torch.zeros(1, 1, dtype=torch.long, device=loaded.view.device)).shape[-1])


@torch.no_grad()
def trace_fact(loaded: LoadedModel, fact: Fact, options: LocateOptions = LocateOptions(), sigma: float | None = None,
               progress: bool = False, latents: Latents | None = None) -> Tracing:
    """Trace one fact: the indirect-effect tables of each restored state, then the memories at the best FF cell,
    and with `latents` having a dictionary at that cell's layer, its latents too.

    Args:
        sigma: the embeddings' standard deviation (computed when None; pass it when tracing many facts).
    """
    view = loaded.view
    if view.encoder:
        raise FfkvError("causal tracing reads the next-token prediction of a causal LM; this model is a masked-LM "
                        "encoder")
    L = view.n_layers
    options.validate(L)
    window = options.window or default_window(L)
    ids = _encode(loaded, fact.prompt)
    subject = subject_positions(loaded, fact.prompt, fact.subject)
    T = len(ids)
    if options.position is not None and not 0 <= options.position < T:
        raise FfkvError(f"position {options.position} is outside the prompt's {T} tokens")
    sigma = embedding_std(view) if sigma is None else sigma
    noise = _noise(view, subject, options, sigma, _embed_width(loaded))
    if fact.answer is not None:
        answer = answer_token(loaded, fact.prompt, fact.answer)
    else:
        logits = loaded.model(input_ids=torch.tensor([ids], device=view.device)).logits[0, -1]
        answer = int(logits.argmax())
    passes = _Passes(loaded, ids, subject, noise, answer)
    base, _ = passes.run([])
    p_clean, p_corrupted = float(base[0]), float(base[1:].mean())

    effects: dict[str, np.ndarray] = {}
    kinds = list(dict.fromkeys(list(options.kinds) + ["ff_out"]))  # the memories' cell is read from ff_out
    bar = progress_bar(progress, len(kinds) * L, "locate", "layer")
    try:
        for kind in kinds:
            table = np.zeros((L, T), dtype=np.float64)
            for layer in range(L):
                layers = [layer] if kind == "hidden" else list(window_layers(layer, window, L))
                site = "hidden" if kind == "hidden" else kind
                groups = [[Restore(site, lay, 0, 0, t) for lay in layers] for t in range(T)]
                table[layer], _ = passes.group_means(groups, options.max_rows)
                bar.update(1)
            effects[kind] = table
    finally:
        bar.close()
    tracing = Tracing(fact, ids, list(loaded.tokenizer.token_strings(ids)), subject, answer,
                      loaded.tokenizer.token_strings([answer])[0], p_clean, p_corrupted, options.noise * sigma,
                      window, {k: effects[k] for k in kinds if k in options.kinds})
    _trace_memories(loaded, passes, tracing, effects["ff_out"], options)
    if latents is not None and tracing.cell[0] in latents.layers:
        _trace_latents(latents, passes, tracing, options)
    return tracing


def _trace_memories(loaded: LoadedModel, passes: _Passes, tracing: Tracing, ff: np.ndarray,
                    options: LocateOptions) -> None:
    """Restore single coefficients at the best FF cell (see the module's docstring, step 4)."""
    view, S = loaded.view, options.samples
    if options.layer is not None and options.position is not None:
        layer, position = options.layer, options.position
    else:
        columns = [options.position] if options.position is not None else range(len(tracing.token_ids))
        rows = [options.layer] if options.layer is not None else range(view.n_layers)
        layer, position = max(((lay, t) for lay in rows for t in columns), key=lambda c: ff[c])
    tracing.cell = (layer, position)
    means, _ = passes.group_means([[Restore("ff_out", layer, 0, 0, position)]], options.max_rows)
    tracing.p_ff_restored = float(means[0])
    _, m = passes.run([], capture_layer=layer)
    clean, corrupted = m[0, position], m[1:, position].mean(0)
    norms = view.values(layer).float().norm(dim=-1).cpu()
    score = (clean - corrupted).abs() * norms
    keys = torch.argsort(score, descending=True, stable=True)[:min(options.candidates, view.d_m)].tolist()
    groups = [[Restore("coefficients", layer, 0, 0, position, key)] for key in keys]
    p, _ = passes.group_means(groups, options.max_rows)
    table = pd.DataFrame({"layer": layer, "position": position, "key": np.array(keys, dtype=np.int64),
                          "coefficient_clean": clean[keys].numpy().astype(np.float64),
                          "coefficient_corrupted": corrupted[keys].numpy().astype(np.float64),
                          "prob": p, "indirect_effect": p - tracing.p_corrupted})
    table = table.sort_values(["indirect_effect", "key"], ascending=[False, True], kind="stable")
    tracing.memories = table.reset_index(drop=True)


def _trace_latents(latents: Latents, passes: _Passes, tracing: Tracing, options: LocateOptions) -> None:
    """Restore single latents at the memories' cell (see the module's docstring, step 5)."""
    layer, position = tracing.cell
    d, S = latents.dictionaries[layer], options.samples
    _, x = passes.run([], capture_layer=layer, captured=latents.reads(layer))
    a = d.encode(x[:, position]).float().cpu()                                  # (1 + S, n_latents)
    clean, corrupted = a[0], a[1:].mean(0)
    score = (clean - corrupted).abs() * d.decoder.float().norm(dim=-1).cpu()
    chosen = torch.argsort(score, descending=True, stable=True)[:min(options.candidates, d.n_latents)].tolist()
    state: dict = {}

    def restored(x: torch.Tensor, ff_out: torch.Tensor) -> torch.Tensor:
        """Each group's corrupted rows get (a_clean − a_row)·dec_j of its latent j added at the cell."""
        rows, T = 1 + len(state["latents"]) * S, passes.ids.shape[1]
        read = x if latents.reads(layer) == "ff_in" else ff_out
        here = d.encode(read.reshape(rows, T, -1)[:, position])                # (rows, n_latents)
        j = torch.tensor(state["latents"], device=here.device).repeat_interleave(S)
        gain = here[0, j] - here[1:].gather(1, j[:, None])[:, 0]               # (rows - 1,)
        out = ff_out.clone()
        out.view(rows, T, -1)[1:, position] += (gain[:, None] * d.decoder[j]).to(out.dtype)
        return out

    per_pass = max(1, (options.max_rows - 1) // S)
    probs = []
    with replace_ff_output(passes.view, {layer: restored}):
        for start in range(0, len(chosen), per_pass):
            state["latents"] = chosen[start:start + per_pass]
            p, _ = passes.run([[] for _ in state["latents"]])
            probs.extend(float(p[1 + g * S:1 + (g + 1) * S].mean()) for g in range(len(state["latents"])))
    p = np.array(probs, dtype=np.float64)
    table = pd.DataFrame({"layer": layer, "position": position, "latent": np.array(chosen, dtype=np.int64),
                          "address": [str(latents.ref(layer, j)) for j in chosen],
                          "activation_clean": clean[chosen].numpy().astype(np.float64),
                          "activation_corrupted": corrupted[chosen].numpy().astype(np.float64),
                          "prob": p, "indirect_effect": p - tracing.p_corrupted})
    table = table.sort_values(["indirect_effect", "latent"], ascending=[False, True], kind="stable")
    tracing.latents = table.reset_index(drop=True)


def locate(loaded: LoadedModel, facts: Iterable[Fact], options: LocateOptions = LocateOptions(),
           progress: bool = False, latents: Latents | None = None) -> list[Tracing]:
    """Trace every fact (one σ for all: the embeddings' standard deviation over the vocabulary); with `latents`,
    the latents of the dictionary at each fact's memory cell too, where there is one."""
    sigma = embedding_std(loaded.view)
    return [trace_fact(loaded, fact, options, sigma, progress, latents) for fact in facts]


# ------------------------------------------------------------------ outputs
def effects_table(tracings: Sequence[Tracing]) -> pd.DataFrame:
    """One row per fact, restored state, layer and position: p_restored and the indirect effect."""
    frames = []
    for i, t in enumerate(tracings):
        for kind, table in t.effects.items():
            L, T = table.shape
            frames.append(pd.DataFrame({
                "fact": i, "kind": kind, "layer": np.repeat(np.arange(L), T), "position": np.tile(np.arange(T), L),
                "token": np.tile(np.array(t.tokens, dtype=object), L),
                "subject": np.tile(np.isin(np.arange(T), t.subject), L),
                "prob": table.reshape(-1), "indirect_effect": (table - t.p_corrupted).reshape(-1)}))
    return pd.concat(frames, ignore_index=True)


def facts_table(tracings: Sequence[Tracing]) -> pd.DataFrame:
    """One row per fact: its prompt, subject, answer token, p_clean, p_corrupted, the total effect, and the
    memories' cell with the whole FF output's effect there."""
    return pd.DataFrame([{
        "fact": i, "prompt": t.fact.prompt, "subject": t.fact.subject, "answer": t.fact.answer,
        "answer_id": t.answer_id, "answer_token": t.answer_token, "subject_positions": list(t.subject),
        "p_clean": t.p_clean, "p_corrupted": t.p_corrupted, "total_effect": t.total_effect,
        "noise_std": t.noise_std, "window": t.window,
        "memory_layer": t.cell[0] if t.cell else None, "memory_position": t.cell[1] if t.cell else None,
        "ff_indirect_effect_at_cell": (t.p_ff_restored - t.p_corrupted) if t.p_ff_restored is not None else None,
    } for i, t in enumerate(tracings)])


def memories_table(tracings: Sequence[Tracing], source: str = "memories") -> pd.DataFrame:
    """Every measured memory (`source` "latents": latent) of every fact, by decreasing indirect effect within a
    fact."""
    frames = [getattr(t, source).assign(fact=i) for i, t in enumerate(tracings) if len(getattr(t, source))]
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def intervene_command(tracing: Tracing, top: int, run: str | None = None) -> str:
    """The `ffkv intervene` command that switches the fact's top memories off (layers from 1 on the command line)."""
    memories = tracing.memories.head(top)
    offs = " ".join("--off " + edit_text(Intervention(int(r.layer), int(r.key), "off"))[1]
                    for r in memories.itertuples())
    return f"ffkv intervene {run or 'RUN'} {offs}"


def heatmap(tracing: Tracing, title: str | None = None):
    """ROME's figure: per restored state, p(answer) restored at each (position, layer), subject tokens starred."""
    from ffkv.experiments.figures import plt

    kinds = list(tracing.effects)
    L, T = next(iter(tracing.effects.values())).shape
    fig, axes = plt.subplots(1, len(kinds), sharey=True, squeeze=False, constrained_layout=True,
                             figsize=(2.5 * len(kinds) + 0.8, max(3.6, 1.8 + 0.3 * T)))
    axes = axes[0]
    colors = {"hidden": "Purples", "ff_out": "Greens", "attn_out": "Reds"}
    labels = [f"{tok}*" if i in tracing.subject else tok for i, tok in enumerate(tracing.tokens)]
    for ax, kind in zip(axes, kinds):
        low = min(tracing.p_corrupted, float(tracing.effects[kind].min()))
        high = max(tracing.p_clean, float(tracing.effects[kind].max()), low + 1e-3)  # a flat map stays readable
        image = ax.pcolormesh(tracing.effects[kind].T, cmap=colors[kind], vmin=low, vmax=high)
        ax.invert_yaxis()
        ax.set_yticks(np.arange(T) + 0.5)
        ax.set_yticklabels([repr(s)[1:-1] for s in labels])
        step = max(1, L // 8)
        ax.set_xticks(np.arange(0, L, step) + 0.5)
        ax.set_xticklabels([str(i + 1) for i in range(0, L, step)])
        ax.set_xlabel("layer" + ("" if kind == "hidden" else f" (window {tracing.window})"))
        ax.set_title(f"restored: {SHORT_LABELS[kind]}", fontsize=9)
        bar = fig.colorbar(image, ax=ax, fraction=0.08, format="%.3g")
        bar.set_label(f"p({tracing.answer_token!r})", fontsize=8)
    text = title or (f"{tracing.fact.prompt!r} -> {tracing.answer_token!r}: p clean {tracing.p_clean:.3f}, "
                     f"corrupted {tracing.p_corrupted:.3f} (* subject)")
    fig.suptitle(textwrap.fill(text, 90), fontsize=9)
    return fig


def write_locate(tracings: Sequence[Tracing], out: str | Path, options: LocateOptions, model_id: str) -> list[Path]:
    """Write OUT/locate_facts.parquet, locate_effects.parquet, locate_memories.parquet (with latents traced, also
    locate_latents.parquet), locate.json and one heatmap per fact, OUT/figures/locate_fact_I.{png,svg}, every file
    atomically. Returns the paths written."""
    from ffkv.experiments.figures import save_figure

    out = Path(out)
    described = {"model": model_id, "options": asdict(options), "method": "causal tracing, Meng et al. 2022",
                 "layers": "layer and position count from 0 in the tables; the figures and the command line "
                           "count layers from 1", "n_facts": len(tracings)}
    written = []
    tables = [("facts", facts_table(tracings)), ("effects", effects_table(tracings)),
              ("memories", memories_table(tracings))]
    if any(len(t.latents) for t in tracings):
        tables.append(("latents", memories_table(tracings, "latents")))
    for name, table in tables:
        arrow = pa.Table.from_pandas(table, preserve_index=False)
        meta = {**(arrow.schema.metadata or {}), b"ffkv": json.dumps(described, default=str).encode()}
        path = out / f"locate_{name}.parquet"
        atomic.write_parquet(path, arrow.replace_schema_metadata(meta))
        written.append(path)
    atomic.write_json(out / "locate.json", described)
    written.append(out / "locate.json")
    for i, t in enumerate(tracings):
        written.extend(save_figure(heatmap(t), out, f"locate_fact_{i}"))
    return written


def to_text(tracing: Tracing, top: int, run: str | None = None) -> str:
    """A fact's trace as readable lines (layers from 1)."""
    lines = [f"prompt {tracing.fact.prompt!r}, subject {tracing.fact.subject!r} (tokens "
             f"{', '.join(str(p) for p in tracing.subject)}), answer {tracing.answer_token!r}",
             f"p clean {tracing.p_clean:.4f}, corrupted {tracing.p_corrupted:.4f}, total effect {tracing.total_effect:+.4f} "
             f"(noise std {tracing.noise_std:.4g})"]
    if tracing.total_effect <= 0:
        lines.append("  the corruption does not lower p(answer): the prediction does not rest on the subject here, "
                     "and the effects below locate nothing")
    for kind, table in tracing.effects.items():
        ie = table - tracing.p_corrupted
        layer, position = np.unravel_index(int(np.argmax(ie)), ie.shape)
        lines.append(f"  {KIND_LABELS[kind]:<28} largest indirect effect {ie[layer, position]:+.4f} at layer "
                     f"{layer + 1}, token {position} {tracing.tokens[position]!r}")
    if tracing.cell is not None:
        layer, position = tracing.cell
        lines.append(f"memories at layer {layer + 1}, token {position} {tracing.tokens[position]!r} (the whole FF "
                     f"output restored there: {tracing.p_ff_restored - tracing.p_corrupted:+.4f}):")
        for r in tracing.memories.head(top).itertuples():
            lines.append(f"  {layer + 1}:{int(r.key):<6} indirect effect {r.indirect_effect:+.4f}  "
                         f"m clean {r.coefficient_clean:+.3f}, corrupted {r.coefficient_corrupted:+.3f}")
        lines.append("switch them off on a corpus: " + intervene_command(tracing, top, run)
                     + ("" if run else "   (RUN: an indexed run of this model, `ffkv index`)"))
    if len(tracing.latents):
        layer, position = tracing.cell
        lines.append(f"latents of the dictionary at layer {layer + 1}, token {position}:")
        for r in tracing.latents.head(top).itertuples():
            lines.append(f"  {r.address:<10} indirect effect {r.indirect_effect:+.4f}  "
                         f"a clean {r.activation_clean:+.3f}, corrupted {r.activation_corrupted:+.3f}")
    return "\n".join(lines)
