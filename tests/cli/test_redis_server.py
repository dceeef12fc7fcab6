"""A private Redis server dies with the process that started it: a test run or `lorafleet up` killed
with SIGKILL (no chance to stop it) leaves no orphaned redis-server behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

REPO_ROOT = Path(__file__).resolve().parents[2]
# starts a server as the suite's fixture and `up` do, says its port, then waits to be killed
PARENT = """
import sys, time
from pathlib import Path
from cli.redis_server import RedisServer
server = RedisServer(Path(sys.argv[1]), append_only=False)
server.start()
print(server.port, flush=True)
time.sleep(600)
"""


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.skipif(sys.platform != "linux", reason="parent-death signals are Linux's")
def test_redis_server_exits_when_its_parent_is_killed(tmp_path: Path) -> None:
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, str(tmp_path)], cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True
    )
    port = int(parent.stdout.readline())
    with redis.Redis(port=port) as client:
        server_pid = client.info("server")["process_id"]
    try:
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 10
        while alive(server_pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(server_pid), "redis-server outlived the process that started it"
    finally:
        if alive(server_pid):
            os.kill(server_pid, signal.SIGKILL)
        parent.stdout.close()
