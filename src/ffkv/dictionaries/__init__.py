"""Sparse dictionaries (transcoders and SAEs) of a model's FF layers, read as key-value memories.

    dictionary.py       `Dictionary`: one layer's dictionary (keys = encoder rows, values = decoder rows) and its
                        verbs (encode, decode); `check_against` a model's layer count and width
    hookpoints.py       hookpoint names -> (FF layer, site): the one table of how libraries spell them
    files.py            reading files safely: safetensors and npz only, sizes checked before reading
    sparsify_layout.py  EleutherAI sparsify's folders: read, and `save_sparsify`
    saelens_layout.py   SAELens's folders: read
    npz_layout.py       one .npz file (ffkv's arrays or Gemma Scope's): read, and `save_npz`
    layouts.py          `open_dictionary`: detect the layout, read a model's dictionaries by layer; `reopen`
                        a run's, checked to be the files it was indexed with
    fidelity.py         a dictionary's fidelity to its layer (FVU, dead latents, loss recovered): the measures

A model's dictionaries are a plain ``dict[int, Dictionary]`` keyed by FF layer. This package sits below
`ffkv.memories` and does not import it: checks against a model take plain ints (`check_against`).
"""

from ffkv.dictionaries.dictionary import ACTIVATIONS, KINDS, Dictionary, check_against
from ffkv.dictionaries.hookpoints import FF_INPUT, FF_OUTPUT, Site, ff_site
from ffkv.dictionaries.layouts import file_problems, open_dictionary, read_one, reopen
from ffkv.dictionaries.npz_layout import save_npz
from ffkv.dictionaries.sparsify_layout import save_sparsify

__all__ = ["ACTIVATIONS", "KINDS", "Dictionary", "check_against", "FF_INPUT", "FF_OUTPUT", "Site", "ff_site",
           "file_problems", "open_dictionary", "read_one", "reopen", "save_npz", "save_sparsify"]
