"""An adapter's identity: a digest of its weights file that several cores compute at once.

A plain sha256 is one sequential chain: on one core it runs at ~1.2 GB/s, slower than an NVMe read
(2–4 GB/s), so checking it paced every cold adapter load (docs/benchmarks.md, issue #27). The
identity is instead a hash of fixed pieces: the sha256 of each PIECE_BYTES piece of the file (at file
offsets 0, P, 2P, …; the last one shorter), then the sha256 of those 32-byte digests concatenated in
order. Pieces hash independently (hashlib releases the GIL), so a reader hands each piece to a thread
as soon as it is read and the check keeps up with the disk. Changing any byte changes its piece's
digest; truncating or appending changes the last piece or the number of pieces: either changes the
whole. The value carries its scheme (`sha256-pieces-8MiB:<hex>`) so it can never be mistaken for,
or compared as, a plain sha256 of the file.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

__all__ = ["DIGEST_CHARS", "HASH_THREADS", "PIECE_BYTES", "SCHEME", "combine", "file_digest", "piece_digest", "pieces"]

PIECE_BYTES = 8 << 20
SCHEME = "sha256-pieces-8MiB"  # names PIECE_BYTES: a digest of other pieces is another scheme
DIGEST_CHARS = len(SCHEME) + 1 + 64
# threads hashing one file's pieces: 4 × ~1.2 GB/s keeps ahead of a 4 GB/s NVMe read
HASH_THREADS = min(4, os.cpu_count() or 1)


def pieces(size: int) -> Iterator[tuple[int, int]]:
    """(start, end) file offsets of each piece of a `size`-byte file, in order (none when empty)."""
    for start in range(0, size, PIECE_BYTES):
        yield start, min(start + PIECE_BYTES, size)


def piece_digest(*parts: bytes | memoryview) -> bytes:
    """The 32-byte sha256 of one piece, given as consecutive parts (a header's tail, then data)."""
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part)
    return digest.digest()


def combine(piece_digests: Iterable[bytes]) -> str:
    """The file's identity from its pieces' digests, in file order: `SCHEME:<hex>`."""
    return f"{SCHEME}:{hashlib.sha256(b''.join(piece_digests)).hexdigest()}"


def file_digest(path: Path) -> str:
    """The identity of the file at `path` (what the registry records of an adapter's weights file)."""
    with path.open("rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        return combine(piece_digest(os.pread(f.fileno(), end - start, start)) for start, end in pieces(size))
