"""ffkv: transformer feed-forward layers read as key-value memories (Geva et al. 2021).

    import ffkv
    run = ffkv.index("ffkv-tiny", ffkv.embedded_corpus("train"), "runs/nb", unit="line", max_examples=2000)
    run = ffkv.analyze(run)
    run.triggers(0, 17); run.values(0, 17); run.metric("values"); run.memory(0, 17); run.trace("And God said")

See `ffkv.api`. Imports are lazy: ``import ffkv`` loads neither torch nor the web stack. It makes ffkv's own
model family known to transformers' Auto classes (`ffkv.hf_auto`): a pruned ffkv-tiny loads with
``AutoModelForCausalLM.from_pretrained``.
"""

from ffkv import hf_auto as _hf_auto

__version__ = "0.1.0"

_hf_auto.install()

__all__ = ["__version__", "open_run", "index", "analyze", "intervene", "embedded_corpus", "Run"]


def __getattr__(name: str):
    if name in ("open_run", "index", "analyze", "intervene", "embedded_corpus", "Run"):
        # Loaded on first use, by name: the modules that read `ffkv.__version__` (store, report) must not
        # depend on the API above them (the import layering of pyproject.toml).
        import importlib

        return getattr(importlib.import_module("ffkv.api"), name)
    raise AttributeError(f"module 'ffkv' has no attribute {name!r}")
