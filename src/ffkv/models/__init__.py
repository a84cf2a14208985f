"""Models: loading by name or path, tokenizers, and ffkv's own model families."""

from ffkv.models.loading import LoadedModel, load_model, register_loader
from ffkv.models.tokenizer import HFTokenizer, Tokenizer

# ffkv's own model families register their loaders on import.
from ffkv.models import fairseq_lm as _fairseq_lm  # noqa: E402,F401
from ffkv.models import gguf_lm as _gguf_lm  # noqa: E402,F401
from ffkv.models import tiny_lm as _tiny_lm  # noqa: E402,F401

__all__ = ["LoadedModel", "load_model", "register_loader", "HFTokenizer", "Tokenizer"]
