"""The key-value memory view of a model: architecture table, hooks, projections (SPEC section 1)."""

from ffkv.memories.architectures import ARCHITECTURES, Architecture, architecture_of, supported_families
from ffkv.memories.view import QUANTITIES, Capture, MemoryView

__all__ = ["ARCHITECTURES", "Architecture", "architecture_of", "supported_families",
           "QUANTITIES", "Capture", "MemoryView"]
