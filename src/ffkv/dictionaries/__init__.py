"""Sparse dictionaries (transcoders and SAEs) of a model's FF layers, read as key-value memories.

    dictionary.py  `Dictionary`: one layer's dictionary (keys = encoder rows, values = decoder rows) and its
                   verbs (encode, decode); `check_against` a model's layer count and width
"""

from ffkv.dictionaries.dictionary import ACTIVATIONS, KINDS, Dictionary, check_against

__all__ = ["ACTIVATIONS", "KINDS", "Dictionary", "check_against"]
