"""Keep freed memory for reuse in the `ffkv` command's process (glibc only).

A CPU forward pass allocates and frees tensors of megabytes in every layer. glibc's
defaults hand such blocks back to the system once freed (`mmap` above a threshold of at
most 32 MiB, trimming the heap's top above twice that), so the next layer page-faults the
same amount in again: on GPT-2 small over short lines, about 4 s of every 28 s went to
the kernel. Raising both thresholds keeps the blocks in the heap, where the next layer
reuses them (the in-process equivalent of the jemalloc or tcmalloc preload that PyTorch's
CPU tuning guides recommend).

What is kept is not bounded by one step's working set by itself: blocks that outlive a step
(its results, the next step's first allocations) pin the freed blocks around them apart, and
the next step's blocks of another size take new memory beside them. On SmolLM2-135M the value
projections of 30 layers (|V|-wide logits, a layer at a time) grew the process from 1.1 GB to
a 6.8 GB peak that way (2.0 GB with glibc's defaults), and its whole analysis peaked at 11.8 GB.
So work that frees large temporaries in a loop hands the free memory back after each round
(`release`, glibc's ``malloc_trim``: 2.3 GB there, in the same time), and so does `analyze`
after each step.

Only the command sets this (`ffkv.cli.console`); importing the library changes nothing in a
user's process. A user who sets glibc's own variables keeps them.
"""

from __future__ import annotations

import ctypes
import os
import platform

#: glibc's `mallopt` parameters (malloc.h).
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3

#: Blocks below this come from the heap, not from `mmap`.
MMAP_THRESHOLD = 256 * 2**20
#: Free memory at the heap's top kept rather than handed back.
TRIM_THRESHOLD = 2**30

#: glibc's environment variables for the same settings; when one is set, the user's choice stands.
ENVIRONMENT = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES")

#: Whether `keep_freed_memory` set this process to keep freed memory (then `release` trims).
_keeping = False


def on_glibc() -> bool:
    """Whether this process runs on Linux with glibc, whose allocator these settings are for."""
    return platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds for this process; return whether they were set.

    Does nothing (returns False) on other C libraries, or when the environment already sets
    one of `ENVIRONMENT`.
    """
    if not on_glibc() or any(name in os.environ for name in ENVIRONMENT):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    global _keeping
    _keeping = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) & bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    return _keeping


def release() -> None:
    """Hand the free memory of this process's heap back to the system (glibc's ``malloc_trim``), where
    `keep_freed_memory` set it to keep freed memory; elsewhere nothing. Called after a round of work whose large
    temporaries are freed (module docstring). It moves where later blocks lie, not what is computed; MKL's matrix
    products may round by their buffers' alignment, which any earlier allocation moves as well (SmolLM2-135M's
    values_keys differ by up to 1e-5 relative between `--only values` and a whole analyze, with or without it)."""
    if _keeping:
        ctypes.CDLL(None).malloc_trim(0)
