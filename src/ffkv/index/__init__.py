"""Streaming exact top-k trigger examples over a corpus (SPEC section 3): the indexer, checkpoints, shards, merge.

The package is also the library function of the same name: ``ffkv.index(model, corpus, out, ...)`` calls
`ffkv.api.index`. Python binds ``ffkv.index`` to this package as soon as any of its modules is imported,
so the package itself must be what answers the call.
"""

import importlib
import sys
import types


class _CallablePackage(types.ModuleType):
    def __call__(self, *args, **kwargs):
        # By name, when called: the API sits above this package in the import layering.
        return importlib.import_module("ffkv.api").index(*args, **kwargs)


sys.modules[__name__].__class__ = _CallablePackage
