"""Streaming exact top-k trigger examples over a corpus (docs/definitions.md): the indexer, checkpoints, shards, merge.

The library function that runs it is `ffkv.index` (`ffkv.api.index`); this package is its engine.
"""
