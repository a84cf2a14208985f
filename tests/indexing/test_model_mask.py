"""Right-padded causal batches need no attention mask: the index runs them without one.

For every supported family, the coefficients at every real position with the mask the
index passes (`model_mask`) equal those of each example run alone, unpadded: the
brute-force reference, independent of any mask handling.
"""

from __future__ import annotations

import pytest
import torch

from ffkv.corpus import Example
from ffkv.batching import collate
from ffkv.indexing.indexer import model_mask
from ffkv.models.loading import LoadedModel
from ffkv.memories.view import MemoryView
from ffkv.models.tiny_lm import FfkvLMConfig, FfkvLMForCausalLM
from support.helpers import CharTokenizer, loaded_tiny
from support.tiny_models import FAMILIES, VOCAB


def _ffkv_lm(positions: str) -> LoadedModel:
    torch.manual_seed(0)
    model = FfkvLMForCausalLM(FfkvLMConfig(vocab_size=VOCAB, hidden_size=16, num_layers=2, num_heads=2,
                                           intermediate_size=24, max_position_embeddings=32,
                                           positions=positions, dropout=0.0)).eval()
    return LoadedModel(model, CharTokenizer(), MemoryView(model), f"tiny-ffkv-lm-{positions}", "float32", "cpu")


def _coefficients(loaded: LoadedModel, input_ids, mask) -> dict[int, torch.Tensor]:
    with loaded.view.capture(("coefficients",)) as cap:
        loaded.view.forward(input_ids, mask)
    return {layer: t.clone() for layer, t in cap["coefficients"].items()}


@pytest.mark.parametrize("family", FAMILIES + ("ffkv_lm-learned", "ffkv_lm-sinusoidal"))
def test_batched_coefficients_equal_lone_examples(family):
    loaded = _ffkv_lm(family.split("-")[1]) if family.startswith("ffkv_lm") else loaded_tiny(family)
    g = torch.Generator().manual_seed(0)
    examples = [Example(i, torch.randint(5, VOCAB, (n,), generator=g).numpy(), "") for i, n in enumerate((9, 3, 6))]
    batch = collate(examples, pad_id=0)
    mask = model_mask(loaded, batch)
    assert (mask is not None) == loaded.view.encoder
    batched = _coefficients(loaded, batch.input_ids, mask)
    for row, e in enumerate(examples):
        n = len(e.token_ids)
        alone = _coefficients(loaded, torch.as_tensor(e.token_ids, dtype=torch.long)[None], None)
        for layer, c in alone.items():
            torch.testing.assert_close(batched[layer][row, :n], c[0], rtol=1e-5, atol=1e-5)
