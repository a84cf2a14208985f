"""Models: loading by name or path, tokenizers, and ffkv's own model families."""

from ffkv.models.loading import LoadedModel, load_model, register_loader
from ffkv.models.tokenizer import HFTokenizer, Tokenizer

__all__ = ["LoadedModel", "load_model", "register_loader", "HFTokenizer", "Tokenizer"]
