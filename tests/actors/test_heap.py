"""actors/workers/heap.py: `release_free_heap` hands freed malloc memory back to the system.

Freed blocks between live ones stay in the process (glibc trims only a heap's top by itself);
malloc_trim(0) returns their pages: the pattern that made the teacher worker's RSS grow in the
memory soak (docs/RELIABILITY.md)."""
import ctypes
import sys

import psutil
import pytest

from actors.workers.heap import release_free_heap

glibc = pytest.mark.skipif(not sys.platform.startswith("linux") or not hasattr(
    ctypes.CDLL(None), "gnu_get_libc_version"), reason="malloc_trim is glibc's")


@glibc
def test_freed_blocks_between_live_ones_come_back():
    rss = lambda: psutil.Process().memory_info().rss / 2 ** 20     # noqa: E731
    release_free_heap()
    blocks = [ctypes.create_string_buffer(16 * 1024) for _ in range(8192)]   # 128 MiB, malloc'd
    for i in range(len(blocks)):
        ctypes.memset(blocks[i], 1, 16 * 1024)                     # touched: resident
    keep = blocks[::64]                                            # pins the heap's top
    del blocks
    held = rss()
    assert release_free_heap() is True
    assert held - rss() > 64, (held, rss())                        # most of the 126 MiB freed
    assert len(keep) == 128
