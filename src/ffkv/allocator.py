"""Keep freed memory for reuse in the `ffkv` command's process (glibc only).

A CPU forward pass allocates and frees tensors of megabytes in every layer. glibc's
defaults hand such blocks back to the system once freed (`mmap` above a threshold of at
most 32 MiB, trimming the heap's top above twice that), so the next layer page-faults the
same amount in again: on GPT-2 small over short lines, about 4 s of every 28 s went to
the kernel. Raising both thresholds keeps the blocks in the heap, where the next layer
reuses them (the in-process equivalent of the jemalloc or tcmalloc preload that PyTorch's
CPU tuning guides recommend). What is kept is bounded by the largest working set of one
step, so it does not grow with the corpus.

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
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) & bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
