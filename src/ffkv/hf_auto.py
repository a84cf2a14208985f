"""ffkv's own model family (``ffkv_lm``) in transformers' Auto classes, from ``import ffkv`` on.

A model ffkv writes in its own format (the embedded ``ffkv-tiny``, a model ``ffkv prune`` made
smaller, one ``ffkv train`` trained) then loads as any Hugging Face model does::

    import ffkv
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained("pruned/")

``import ffkv`` stays light (it imports neither torch nor transformers): `install` puts a finder on
``sys.meta_path`` that registers the family as transformers' auto modules are first imported: the
configuration with ``AutoConfig`` after ``configuration_auto``, the model with ``AutoModelForCausalLM``
after ``modeling_auto`` (the model classes cannot be defined while that module is still importing);
or at once for a module that is imported already.
"""

from __future__ import annotations

import importlib
import importlib.abc
import sys
import warnings

#: transformers' modules whose import registers a part of the family: module -> the class of
#: `ffkv.models.tiny_lm` whose definition registers itself.
TRIGGERS = {"transformers.models.auto.configuration_auto": "FfkvLMConfig",
            "transformers.models.auto.modeling_auto": "FfkvLMForCausalLM"}
_done: set[str] = set()


def register(module: str) -> None:
    """Register the part of ffkv's model family that transformers' `module` (one of `TRIGGERS`) serves."""
    if module in _done:
        return
    _done.add(module)
    try:
        # By name, as `ffkv.__getattr__` loads the API: the modules that read `ffkv.__version__` (store) must
        # not depend on the models (the import layering of pyproject.toml).
        tiny_lm = importlib.import_module("ffkv.models.tiny_lm")
        tiny_lm.__getattr__(TRIGGERS[module])  # defining the class registers it
    except Exception as exc:  # noqa: BLE001 - never break the user's import of transformers
        warnings.warn(f"ffkv could not register its model family with transformers' Auto classes: {exc}",
                      stacklevel=2)


class _Loader(importlib.abc.Loader):
    """Runs the real loader, then `register`; anything else it is asked is the real loader's."""

    def __init__(self, loader, name: str) -> None:
        self._loader, self._name = loader, name

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        register(self._name)

    def __getattr__(self, name: str):
        return getattr(self._loader, name)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds a module of `TRIGGERS` with the other finders and wraps its loader in `_Loader`."""

    def find_spec(self, name, path=None, target=None):
        if name not in TRIGGERS or name in _done:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _Loader(spec.loader, name)
                return spec
        return None


def install() -> None:
    """Register each part of the family now if its transformers module is imported already, else when it is."""
    for module in TRIGGERS:
        if module in sys.modules:
            register(module)
    if len(_done) < len(TRIGGERS) and not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
