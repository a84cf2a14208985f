"""Sparse coefficients (a TopK dictionary's latents: a few active keys per position), reduced without the dense tensor.

A TopK dictionary activates k of its n latents at each position, so its dense (B, T, n) activations are zeros but
for B·T·k entries. `SparseCoefficients` holds those entries, and the two functions here give, from them alone,
what `ffkv.indexing.reducer.TriggerReducer` takes from the dense tensor, for the keys that fired (a > 0):

- `best_per_example` (mode ``example``): per example and key, the largest coefficient over the example's competing
  positions, and the first position that has it;
- `top_prefixes` (mode ``prefix``): per key, the n largest coefficients over the batch's competing positions, ties
  going to the lower (example, position) column, as `ffkv.indexing.topk.select_top` breaks them.

What the dense reduction adds beyond these are zeros (a key that did not fire), and the latent tables keep only
coefficients > 0 (`ffkv.indexing.tables.latent_trigger_table`), so the tables are the dense reduction's, row for
row. The work is O(B·T·k) per layer, and O(B·n) in mode example, instead of O(B·T·n).
"""

from __future__ import annotations

import torch
from jaxtyping import Bool, Float, Int

from ffkv.indexing.topk import column_ranking
from ffkv.memories.latent_keys import SparseCoefficients


def best_per_example(c: SparseCoefficients, competes: Bool[torch.Tensor, "batch pos"]
                     ) -> tuple[Float[torch.Tensor, "batch n_keys"], Int[torch.Tensor, "batch n_keys"]]:
    """Per example and key, the largest coefficient over the competing positions (0 where the key did not fire
    there), in float32, and the first position that has it (0 where it is 0)."""
    b, t, k = c.values.shape
    values = torch.where(competes[..., None], c.values.float(), 0.0).reshape(b, t * k)
    keys = c.indices.reshape(b, t * k)
    best = values.new_zeros(b, c.n_keys).scatter_reduce_(1, keys, values, "amax")
    position = torch.arange(t, device=values.device).repeat_interleave(k).expand(b, -1)
    hit = (values > 0) & (values == best.gather(1, keys))
    first = torch.full((b, c.n_keys), t, dtype=torch.int64, device=values.device)
    first.scatter_reduce_(1, keys, torch.where(hit, position, t), "amin")
    return best, first.masked_fill_(first == t, 0)


def top_prefixes(c: SparseCoefficients, competes: Bool[torch.Tensor, "batch pos"], n: int
                 ) -> tuple[Float[torch.Tensor, "n_keys n"], Int[torch.Tensor, "n_keys n"]]:
    """Per key, its n largest coefficients > 0 over the competing positions, best first, ties to the lower column
    (b·T + t), in float32, and their columns; a key that fired at fewer places has -inf at column -1 after them."""
    b, t, k = c.values.shape
    values, keys = c.values.float().reshape(-1), c.indices.reshape(-1)
    columns = torch.arange(b * t, device=values.device).repeat_interleave(k)
    # Entries that did not fire stay, at -inf, so that no shape depends on the data (no device sync).
    values = torch.where((values > 0) & competes.reshape(-1).repeat_interleave(k), values, float("-inf"))
    order = column_ranking(values, columns, b * t).argsort(descending=True)
    order = order[keys[order].argsort(stable=True)]                  # by key, each key's entries best first
    values, keys, columns = values[order], keys[order], columns[order]
    rank = (torch.arange(len(keys), device=values.device) - torch.searchsorted(keys, keys)).clamp_(max=n)
    top = torch.full((c.n_keys, n + 1), float("-inf"), device=values.device)  # column n: the ranks past n
    where = torch.full((c.n_keys, n + 1), -1, dtype=torch.int64, device=values.device)
    top.index_put_((keys, rank), values)
    where.index_put_((keys, rank), torch.where(values > 0, columns, -1))
    return top[:, :n], where[:, :n]


__all__ = ["SparseCoefficients", "best_per_example", "top_prefixes"]
