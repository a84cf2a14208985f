"""Per-key lookup tables the explorer computes once per run, with the model (SPEC sections 4 and 6).

For every key of every layer: its value's top tokens with probabilities (the projection
p_i = softmax(v_i·Eᵀ), identity normalization as in the paper), the confidence max p_i,
whether the argmax agrees with the next token of the key's top-1 trigger example, that
token's rank in p_i, the log-normaliser of p_i (so p_i(x) of any token x is one dot product
later), ‖v_i‖, and how often the key is active (m_i > 0) over a sample of the corpus.
Values are projected `chunk` keys at a time (`ffkv.memories.projection.scan_values`, as the values
experiment does), never L x d_m x |V| at once.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow as pa
import torch

from ffkv.memories.projection import DEFAULT_FOR_VALUES, scan_values
from ffkv.models.loading import LoadedModel
from ffkv.store import schemas


def value_tables(loaded: LoadedModel, top1_target: np.ndarray, top_tokens: int = 10, chunk: int = 512,
                 projection: str = DEFAULT_FOR_VALUES) -> tuple[pa.Table, pd.DataFrame]:
    """The value_top_tokens table and the per-key value statistics (`scan_values`, as the values experiment).

    Args:
        top1_target: (L, d_m) trigger target (`ffkv.memories.targets`) of each key's top-1 trigger
            example (-1: none).
    """
    view = loaded.view
    tops, stats = [], []
    for layer in range(view.n_layers):
        norms = view.values(layer).float().norm(dim=1).cpu().numpy()
        targets = np.asarray(top1_target[layer], dtype=np.int64)
        targets = np.where(targets < view.vocab_size, targets, -1)
        s = scan_values(view, layer, projection, targets, chunk=chunk, top=top_tokens)
        d_m, k = s["top_token_ids"].shape
        keys = np.arange(d_m)
        tops.append(pd.DataFrame({
            "layer": np.int16(layer), "key": np.repeat(keys, k).astype(np.int32),
            "rank": np.tile(np.arange(k, dtype=np.int16), d_m),
            "token_id": s["top_token_ids"].astype(np.int32).ravel(),
            "prob": s["top_probs"].astype(np.float32).ravel(),
        }))
        has = s["target_rank"] >= 0
        stats.append(pd.DataFrame({
            "layer": np.int16(layer), "key": keys.astype(np.int32),
            "confidence": s["top_prob"].astype(np.float32),
            "top_token_id": s["top_token_id"].astype(np.int32),
            "agreement": has & (s["top_token_id"] == targets),
            # 0-based here (tokens strictly more probable); the pages show it 1-based.
            "next_token_rank": np.where(has, s["target_rank"] - 1, -1).astype(np.int32),
            "logsumexp": s["logsumexp"].astype(np.float32),
            "value_norm": norms.astype(np.float32),
        }))
    table = pa.Table.from_pandas(pd.concat(tops, ignore_index=True), schema=schemas.VALUE_TOP_TOKENS, preserve_index=False)
    return table, pd.concat(stats, ignore_index=True)


@torch.no_grad()
def activation_frequency(loaded: LoadedModel, token_lists: list[list[int]], batch_size: int = 16,
                         max_tokens: int = 128) -> np.ndarray:
    """(L, d_m) share of token positions of the sample where m_i > 0 (SPEC section 7's "active")."""
    view = loaded.view
    counts = torch.zeros(view.n_layers, view.d_m, dtype=torch.float64)
    total = 0
    token_lists = [list(t)[:max_tokens] for t in token_lists if len(t)]
    mask_holder: dict[str, torch.Tensor] = {}

    def sink(quantity: str, layer: int, m: torch.Tensor) -> None:
        mask = mask_holder["mask"]
        counts[layer] += ((m > 0) & mask[..., None]).sum(dim=(0, 1)).double().cpu()

    with view.capture(("coefficients",), sink=sink):
        for i in range(0, len(token_lists), batch_size):
            group = token_lists[i:i + batch_size]
            width = max(len(t) for t in group)
            ids = torch.full((len(group), width), loaded.tokenizer.pad_id, dtype=torch.long)
            mask = torch.zeros((len(group), width), dtype=torch.bool)
            for row, tokens in enumerate(group):
                ids[row, :len(tokens)] = torch.tensor(tokens)
                mask[row, :len(tokens)] = True
            mask_holder["mask"] = mask.to(view.device)
            view.forward(ids.to(view.device), mask.long().to(view.device))
            total += int(mask.sum())
    return (counts / max(total, 1)).numpy().astype(np.float32)
