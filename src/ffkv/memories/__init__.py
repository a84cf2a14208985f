"""The key-value memory view of a model (docs/definitions.md), and all model-side math built on it.

    architectures.py  where each family keeps its FF memories: the one per-family table
    view.py           `MemoryView`: keys, values, norms, the unembedding, and captures (every hook)
    projection.py     p(h) = softmax(N(h)·Eᵀ); the chunked projection of a layer's values
    targets.py        the trigger target: the token a key's value should predict
    active.py         which memories are active: the one rule, and its scale without massive activations
    controls.py       random key directions of each layer's shape: the control of every key-side finding
    interventions.py  switch memories off, scale or set their coefficients
    pruning.py        remove memories: masked (m_i = 0) or cut out of the weights (a smaller model)
    dictionary_fidelity.py  the model's passes for a dictionary's fidelity (`ffkv.dictionaries.fidelity`)
"""

from ffkv.memories.architectures import ARCHITECTURES, Architecture, architecture_of, supported_families
from ffkv.memories.interventions import Intervention, intervene
from ffkv.memories.view import QUANTITIES, Capture, MemoryView

__all__ = ["ARCHITECTURES", "Architecture", "architecture_of", "supported_families",
           "QUANTITIES", "Capture", "MemoryView", "Intervention", "intervene"]
