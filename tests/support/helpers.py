"""Test helpers: a character tokenizer for tiny models and a loaded tiny model."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import pandas as pd
import pyarrow as pa

from ffkv.memories.view import MemoryView
from ffkv.models.loading import LoadedModel
from ffkv.store import atomic, schemas
from ffkv.store.run import RunDir
from support.tiny_models import VOCAB, tiny_model


class CharTokenizer:
    """One id per character (ids 4..VOCAB-1), optionally a BOS id 1 first; pad id 0; mask id 3 (what an encoder's
    held-out position is replaced with)."""

    def __init__(self, bos: bool = False, eos: bool = False) -> None:
        self.bos, self.eos = bos, eos

    vocab_size = VOCAB
    pad_id = 0
    mask_id = 3
    special_ids = frozenset({1, 2})

    def encode(self, text: str) -> list[int]:
        ids = [4 + (ord(ch) % (VOCAB - 4)) for ch in text]
        return ([1] if self.bos else []) + ids + ([2] if self.eos else [])

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(self.token_strings(ids))

    def token_strings(self, ids: Sequence[int]) -> list[str]:
        return [{0: "<pad>", 1: "<s>", 2: "</s>", 3: "<mask>"}.get(int(i), chr(int(i) - 4 + 32)) for i in ids]


def loaded_tiny(family: str, seed: int = 0, **tokenizer_options) -> LoadedModel:
    """A tiny model of the family with a character tokenizer, as `load_model` would return it."""
    model = tiny_model(family, seed)
    model.requires_grad_(False)
    return LoadedModel(model, CharTokenizer(**tokenizer_options), MemoryView(model), f"tiny-{family}", "float32", "cpu")


def on_device(loaded: LoadedModel, device: str) -> LoadedModel:
    """`loaded` with its model moved to `device` (the GPU tests: the same weights on CUDA)."""
    model = loaded.model.to(device)
    return LoadedModel(model, loaded.tokenizer, MemoryView(model), loaded.model_id, loaded.dtype, device)


def assert_memory_view_consistent(view, cap, activation=None) -> None:
    """Captured m, ff_out and resid_post agree with the raw weights (SPEC section 1), every layer.

    m = f(x·Kᵀ + b_K) recomputed from the FF input; FF(x) = Σ_i m_i v_i + b_V;
    resid_post = resid_mid + ff_out. `activation` defaults to the layer's own f.
    """
    import torch

    for layer in range(view.n_layers):
        m, x = cap["coefficients"][layer], cap["ff_in"][layer]
        f = activation or view.activation(layer)
        bias = view.key_bias(layer) if view.key_bias(layer) is not None else 0
        torch.testing.assert_close(m, f(x @ view.keys(layer).T + bias))
        ff = torch.einsum("btm,md->btd", m, view.values(layer))
        if view.value_bias(layer) is not None:
            ff = ff + view.value_bias(layer)
        torch.testing.assert_close(cap["ff_out"][layer], ff, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(cap["resid_post"][layer], cap["resid_mid"][layer] + cap["ff_out"][layer])


def held_out_scale(loaded: LoadedModel, held) -> "np.ndarray":
    """s_l by brute force (docs/definitions.md): each held-out example (`ffkv.experiments.common.HeldOut`) run
    alone, the RMS of every coefficient at its analysed position, positions above 20 x the median RMS left out,
    then the RMS of the rest, per layer."""
    import numpy as np
    import torch

    view = loaded.view
    squares = np.zeros((len(held.examples), view.n_layers))
    for i, (e, j) in enumerate(zip(held.examples, held.positions)):
        with torch.no_grad(), view.capture(("coefficients",)) as cap:
            view.forward(torch.tensor([list(e.token_ids)]))
        for layer in range(view.n_layers):
            squares[i, layer] = float(cap["coefficients"][layer][0, int(j)].double().square().mean())
    rms = np.sqrt(squares)
    kept = [rms[:, layer][rms[:, layer] <= 20 * np.median(rms[:, layer])] for layer in range(view.n_layers)]
    return np.array([np.sqrt(np.mean(k ** 2)) for k in kept])


def replace_triggers(run: str | Path, triggers: pd.DataFrame) -> None:
    """Replace a run's trigger_examples.parquet by hand-set rows (its schema) and record the new table in the
    manifest as the index would, so that the integrity check (`ffkv.store.integrity`) reads it as written."""
    run = RunDir(run)
    table = pa.Table.from_pandas(triggers[[f.name for f in schemas.TRIGGER_EXAMPLES]], schema=schemas.TRIGGER_EXAMPLES,
                                 preserve_index=False)
    atomic.write_parquet(run.table("trigger_examples"), table)
    manifest = run.manifest()
    run.record_table(manifest, run.table("trigger_examples").name, "index")
    run.write_manifest(manifest)
