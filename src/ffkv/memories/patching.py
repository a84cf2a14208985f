"""Causal patching (Meng et al. 2022, causal tracing): corrupt the input embeddings of some rows of a batch,
and restore chosen activations of those rows from a clean row of the same batch.

A batch holds one clean row (row 0 by convention) and corrupted rows: the output of the input embedding
(`Architecture.embed`) gets `noise` added at the corrupted positions. A `Restore` copies, in a range of
rows and at one position, one site of one layer from the clean row:

- ``hidden``: the block's output (the residual stream after the layer, ROME's "hidden state");
- ``attn_out``: the attention module's output;
- ``ff_out``: the FF output FF(x), the second matrix's output;
- ``coefficients``: one memory coefficient m_i (the second matrix's input), or all of them.

Since the clean row runs through the same pass unchanged, what is copied is exactly the clean run's value
at that layer, and later layers see the restored state. Hooks exist only inside `corrupt_and_restore`;
leaving it restores the model exactly (as `ffkv.memories.interventions` does).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterable, Iterator

import torch
from jaxtyping import Float

from ffkv.errors import FfkvError
from ffkv.memories.view import MemoryView

SITES = ("hidden", "attn_out", "ff_out", "coefficients")


@dataclass(frozen=True)
class Restore:
    """Rows `start..stop-1` get `site` of `layer` at `position` from the clean row (`feature`: one coefficient
    m_feature only, site ``coefficients``)."""

    site: str
    layer: int
    start: int
    stop: int
    position: int
    feature: int | None = None

    def __post_init__(self) -> None:
        if self.site not in SITES:
            raise FfkvError(f"unknown site {self.site!r}; choose from {', '.join(SITES)}")
        if self.feature is not None and self.site != "coefficients":
            raise FfkvError("a single feature is restored only for the site 'coefficients'")


def _module(view: MemoryView, site: str, layer: int):
    block = view.blocks[layer]
    if site == "hidden":
        return block
    if site == "attn_out":
        return view.arch.attention(block)
    return view.arch.down_proj(block)  # ff_out: its output; coefficients: its input


def _patched(t: torch.Tensor, shape: tuple[int, int], restores: list[Restore], clean_row: int) -> torch.Tensor:
    """A copy of t (batch, pos, ...) or t flattened (batch·pos, ...) with the restores applied."""
    out = t.clone()
    batched = out.view(shape[0], shape[1], -1) if out.dim() == 2 else out
    for r in restores:
        if r.feature is None:
            batched[r.start:r.stop, r.position] = batched[clean_row, r.position]
        else:
            batched[r.start:r.stop, r.position, r.feature] = batched[clean_row, r.position, r.feature]
    return out


@contextmanager
def corrupt_and_restore(view: MemoryView, shape: tuple[int, int], positions: Iterable[int],
                        noise: Float[torch.Tensor, "batch n_positions d_embed"], restores: Iterable[Restore] = (),
                        clean_row: int = 0) -> Iterator[None]:
    """Within the block, a forward pass of a batch of `shape` (batch, pos) adds `noise[b, j]` to the input
    embedding of row b at `positions[j]` (give zeros for the clean row), and applies the restores.

    Args:
        shape: (batch, positions) of the input ids of the passes run inside the block.
        positions: the corrupted token positions (e.g. the subject's tokens).
        noise: what is added to the embeddings there.
        restores: what is copied from the clean row.
        clean_row: the row left uncorrupted and read by the restores.
    """
    positions = list(positions)
    if noise.shape[0] != shape[0] or noise.shape[1] != len(positions):
        raise FfkvError(f"noise of shape {tuple(noise.shape)} does not fit {shape[0]} rows x {len(positions)} positions")
    if float(noise[clean_row].abs().max()) != 0.0:
        raise FfkvError("the clean row must get no noise")
    index = torch.tensor(positions, dtype=torch.long, device=noise.device)

    def corrupt(module, args, out):
        x = out.clone()
        x[:, index] = x[:, index] + noise.to(dtype=x.dtype, device=x.device)
        return x

    grouped: dict[tuple[str, int], list[Restore]] = {}
    for r in restores:
        if not 0 <= r.layer < view.n_layers:
            raise FfkvError(f"layer {r.layer} does not exist: this model has layers 0..{view.n_layers - 1}")
        if not 0 <= r.position < shape[1]:
            raise FfkvError(f"position {r.position} is outside the prompt's {shape[1]} tokens")
        grouped.setdefault((r.site, r.layer), []).append(r)

    handles = [view.arch.embed(view.model).register_forward_hook(corrupt)]
    for (site, layer), group in grouped.items():
        module = _module(view, site, layer)
        if site == "coefficients":
            def pre(mod, args, group=group):
                return (_patched(args[0], shape, group, clean_row), *args[1:])
            handles.append(module.register_forward_pre_hook(pre))
        else:
            def post(mod, args, out, group=group):
                if isinstance(out, tuple):  # attention modules and older blocks return (output, extras...)
                    return (_patched(out[0], shape, group, clean_row), *out[1:])
                return _patched(out, shape, group, clean_row)
            handles.append(module.register_forward_hook(post))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@torch.no_grad()
def embedding_std(view: MemoryView, chunk: int = 4096) -> float:
    """The standard deviation of the entries of the input embeddings of the whole vocabulary (the output of
    `Architecture.embed` for every token id), in float64, a chunk of ids at a time."""
    embed = view.arch.embed(view.model)
    vocab = int(getattr(embed, "num_embeddings", view.vocab_size))
    total, sq, n = 0.0, 0.0, 0
    for start in range(0, vocab, chunk):
        ids = torch.arange(start, min(start + chunk, vocab), device=view.device)[None]
        e = embed(ids).double()
        total += float(e.sum())
        sq += float((e * e).sum())
        n += e.numel()
    mean = total / n
    return float(max(sq / n - mean * mean, 0.0) ** 0.5)
