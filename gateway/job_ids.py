"""Job ids: `job_` and 128 random bits as hex, unguessable, so knowing one job's id tells nothing of another's."""

from __future__ import annotations

import os
import re

JOB_ID = re.compile(r"^job_[0-9a-f]{32}$")

# Job ids are cut from blocks of the OS's random bytes, 4 KiB a read: each id's 128 bits are its own,
# as unguessable as a read per id, without a system call per submit (bench/gateway.py)
_JOB_ID_BYTES = 16
_JOB_IDS_PER_READ = 256
_unused_job_ids: list[str] = []
os.register_at_fork(after_in_child=_unused_job_ids.clear)  # a forked process never shares its parent's


def new_job_id() -> str:
    """An unguessable job id: `job_` + 128 random bits as hex."""
    if not _unused_job_ids:
        block = os.urandom(_JOB_ID_BYTES * _JOB_IDS_PER_READ).hex()
        width = 2 * _JOB_ID_BYTES
        _unused_job_ids.extend(f"job_{block[i : i + width]}" for i in range(0, len(block), width))
    return _unused_job_ids.pop()
