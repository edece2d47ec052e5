"""Handing the C heap's free pages back to the system after a worker's call.

The memory soak (scripts/memory_soak.py) found the teacher worker's RSS rising ~4 MiB per 100
steps while its Python objects stayed the same in number (a gc count, flat to the object from
step 250 to 2,000) and `malloc_trim(0)` at step 2,000 took it from 677.9 back to 639.1 MiB,
where it stood at step 150: not a leak but freed memory that glibc malloc keeps.  Each scoring
call makes and frees buffers of several sizes (the teacher's forward, the log-probs, one
Parquet-free numpy piece per learner rank and Ray's serialization of them) in the thread that
runs the call; the free chunks are scattered between live ones, so glibc's own trimming, which
only releases the top of a heap, gives back little.  `malloc_trim(0)` releases the free pages
inside every arena (docs/RELIABILITY.md, the memory table).

    release_free_heap()      # after a call that made and dropped large temporaries
"""
from __future__ import annotations

import ctypes
import functools


@functools.lru_cache(maxsize=1)
def _malloc_trim():
    """glibc's `malloc_trim`, or None where the C library has none (musl, macOS)."""
    try:
        return ctypes.CDLL(None).malloc_trim      # the symbols the process has loaded: its libc
    except (OSError, AttributeError):
        return None


def release_free_heap() -> bool:
    """Return the free pages of every malloc arena to the system; False where not glibc."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
