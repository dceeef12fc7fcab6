"""The disk's floor for a cold read: files read plainly and sequentially, the page cache dropped first.

`drop_page_cache` writes 3 to /proc/sys/vm/drop_caches where it may (root on the GPU machines: every
clean page goes), else asks the kernel to drop the files' own pages (posix_fadvise DONTNEED), which
it does for clean pages of files nobody has mapped. `read_floor` reads the files one after another
into one reused 64 MiB buffer, as plain as a read gets, and is what the cold rows are divided by.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path

_BUFFER_BYTES = 64 << 20


def drop_page_cache(paths: Sequence[Path]) -> str:
    """Evict `paths` from the page cache; returns how ("drop_caches" or "fadvise")."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return "drop_caches"
    except OSError:
        for path in paths:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        return "fadvise"


def read_floor(paths: Sequence[Path]) -> float:
    """Bytes/s of plain sequential reads of `paths` into one reused buffer, the page cache dropped."""
    drop_page_cache(paths)
    view = memoryview(bytearray(_BUFFER_BYTES))
    total = 0
    start = time.perf_counter()
    for path in paths:
        with path.open("rb", buffering=0) as f:
            while read := f.readinto(view):
                total += read
    return total / (time.perf_counter() - start)
