"""The Redis server `lorafleet up` runs itself, with append-only persistence in STATE_DIR/redis.

It keeps the port of the previous run when it can, so URLs that clients saved keep working. A
server left running by a previous `up` that was killed (it runs in its own session, so it outlives
its parent) is shut down first: two servers appending to one AOF would corrupt it.
"""

from __future__ import annotations

import socket
import time
from pathlib import Path
from urllib.parse import urlparse

import redis
import structlog
from redis.backoff import NoBackoff
from redis.retry import Retry

from cli.errors import CommandError
from cli.redis_server import RedisServer, free_port
from cli.state import FleetState, StateError

log = structlog.get_logger(__name__)

_LOOPBACK = "127.0.0.1"


def _previous_port(state_dir: Path) -> int | None:
    try:
        url = urlparse(FleetState.load(state_dir).redis_url)
        return url.port if url.scheme == "redis" and url.hostname == _LOOPBACK else None
    except (StateError, ValueError):  # no state file, or a URL with a malformed port
        return None


def port_is_free(host: str, port: int) -> bool:
    # SO_REUSEADDR, as servers set it: a port in TIME_WAIT from the last run still counts as free
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def _shut_down_leftover(port: int, data_dir: Path, timeout_s: float = 10.0) -> None:
    """Shut down the Redis on `port` if it is one an earlier run left serving `data_dir`."""
    # one try each: whatever listens there (if anything) answers at once or is not our Redis
    probe = redis.Redis(
        host=_LOOPBACK, port=port, socket_timeout=1.0, socket_connect_timeout=1.0, retry=Retry(NoBackoff(), 0)
    )
    with probe as client:
        try:
            served_dir = client.config_get("dir").get("dir")
        except redis.RedisError:  # nothing listens there, or it is not a Redis
            return
        if served_dir is None or Path(served_dir).resolve() != data_dir.resolve():
            return
        log.warning("leftover_redis", port=port, data_dir=str(data_dir), action="shutting it down")
        try:
            client.shutdown()  # persists the AOF, then exits
        except redis.RedisError as exc:
            raise CommandError(
                f"a Redis server from an earlier run serves {data_dir} on port {port} "
                f"and refused to shut down ({exc}); stop it first"
            ) from exc
    deadline = time.monotonic() + timeout_s
    while not port_is_free(_LOOPBACK, port):
        if time.monotonic() > deadline:
            raise CommandError(
                f"a Redis server from an earlier run still serves {data_dir} on port {port}; stop it first"
            )
        time.sleep(0.1)


def start_embedded_redis(state_dir: Path) -> RedisServer:
    data_dir = state_dir / "redis"
    port = _previous_port(state_dir)
    if port is not None:
        _shut_down_leftover(port, data_dir)
        if not port_is_free(_LOOPBACK, port):
            port = None
    server = RedisServer(data_dir, port=port or free_port(), append_only=True)
    server.start()
    log.info("redis_started", url=server.url, data_dir=str(data_dir))
    return server
