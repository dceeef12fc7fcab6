"""The one way every process (gateway, worker, CLI) opens Redis: a plain server or a Sentinel-watched
primary, behind a client that rides out a restart or a failover.

Where Redis is travels as one string (flags, `$REDIS_URL`, the state file `up` writes, a child's
command line): `redis://host:port/db`, or `redis+sentinel://host:port[,host:port...]/MASTER[/db]` for
a primary that Sentinels watch. A Sentinel client asks the Sentinels for the primary on every
(re)connect, so after a failover its next connection reaches the promoted replica; a connection that
finds its server demoted to a replica (READONLY) is dropped like a lost one.

Every command is retried on a connection error or timeout with exponential backoff and jitter, so a
Redis restart or a Sentinel failover of a few seconds shows up as latency, not as errors. Past the
retries the error reaches the caller, whose loops log it, back off and carry on.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlparse

import redis
import redis.sentinel
from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel, SentinelManagedConnection
from redis.backoff import ExponentialWithJitterBackoff
from redis.exceptions import ConnectionError, TimeoutError

SENTINEL_SCHEME = "redis+sentinel"
# 0.05 s doubling to 2 s: 10 retries span about 10 s, longer than a Redis restart with a small AOF
# and than a failover whose Sentinels have down-after-milliseconds of a few seconds
RETRIES = 10
BACKOFF_BASE_S = 0.05
BACKOFF_CAP_S = 2.0
CONNECT_TIMEOUT_S = 5.0
# a Sentinel answers from memory: one that is slow is down, and the next one is asked
SENTINEL_TIMEOUT_S = 1.0


@dataclass(frozen=True, slots=True)
class SentinelAddress:
    """A primary known by its Sentinels: where they listen and the name they know it by."""

    sentinels: tuple[tuple[str, int], ...]
    master_name: str
    db: int = 0

    @classmethod
    def parse(cls, url: str) -> SentinelAddress:
        """Parse `redis+sentinel://host:port[,host:port...]/MASTER[/db]`; ValueError names what is wrong."""
        rest = url.removeprefix(f"{SENTINEL_SCHEME}://")
        hosts, _, path = rest.partition("/")
        master_name, _, db = path.partition("/")
        if not hosts or not master_name:
            raise ValueError(f"expected {SENTINEL_SCHEME}://HOST:PORT[,HOST:PORT...]/MASTER[/DB], got {url!r}")
        try:
            sentinels = tuple(_host_port(host) for host in hosts.split(","))
            return cls(sentinels, master_name, int(db or 0))
        except ValueError:
            raise ValueError(f"{url!r}: a Sentinel is HOST:PORT and the database a number") from None

    @property
    def url(self) -> str:
        hosts = ",".join(f"{host}:{port}" for host, port in self.sentinels)
        return f"{SENTINEL_SCHEME}://{hosts}/{self.master_name}/{self.db}"


def sentinel_url(sentinels: str, master_name: str) -> str:
    """The URL for `--redis-sentinel host:port[,host:port...] --redis-master-name NAME`; ValueError if malformed."""
    return SentinelAddress.parse(f"{SENTINEL_SCHEME}://{sentinels}/{master_name}").url


def is_sentinel_url(url: str) -> bool:
    return url.startswith(f"{SENTINEL_SCHEME}://")


def check_redis_url(url: str) -> str:
    """`url` if it is a Redis URL lorafleet can open; ValueError saying why not."""
    if is_sentinel_url(url):
        SentinelAddress.parse(url)
    elif urlparse(url).scheme not in ("redis", "rediss", "unix"):
        raise ValueError(f"expected redis://, rediss://, unix:// or {SENTINEL_SCHEME}://, got {url!r}")
    return url


def _host_port(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(text)
    return host, int(port)


class _PrimaryConnection(SentinelManagedConnection):
    """redis-py's Sentinel connection, asking the Sentinels for the primary on every connect. redis-py's
    own reconnects a lost connection, when a command is sent on it again, to the address it had (its
    `send_packed_command` connects without the Sentinel lookup): after a failover, to the dead primary."""

    async def connect_check_health(self, check_health: bool = True, retry_socket_connect: bool = True) -> None:
        if self.is_connected:
            return
        self.host, self.port = await self.connection_pool.get_master_address()
        # one try: the caller's retry (the command's, or `connect`'s) backs off and asks the Sentinels again
        await super().connect_check_health(check_health=check_health, retry_socket_connect=False)


class _SyncPrimaryConnection(redis.sentinel.SentinelManagedConnection):
    """`_PrimaryConnection` for the blocking client (redis-py's has the same stale reconnect)."""

    def connect_check_health(self, check_health: bool = True, retry_socket_connect: bool = True) -> None:
        if self._sock:
            return
        self.host, self.port = self.connection_pool.get_master_address()
        super().connect_check_health(check_health=check_health, retry_socket_connect=False)


def _master_for(address: SentinelAddress, options: dict[str, object]) -> Redis:
    sentinel_options = {"socket_timeout": SENTINEL_TIMEOUT_S, "socket_connect_timeout": SENTINEL_TIMEOUT_S}
    sentinel = Sentinel(address.sentinels, sentinel_kwargs=sentinel_options)
    return sentinel.master_for(
        address.master_name, redis_class=Redis, connection_class=_PrimaryConnection, db=address.db, **options
    )


def resilient_redis(url: str, *, socket_timeout_s: float | None) -> Redis:
    """A client for `url` whose commands retry through a restart or failover. `socket_timeout_s` must
    outlast the longest blocking command the caller issues (XREAD/XREADGROUP BLOCK, WAIT); None: no
    socket timeout, for a caller that times its commands itself (gateway/auto_pipeline.py)."""
    options = {
        "socket_timeout": socket_timeout_s,
        "socket_connect_timeout": CONNECT_TIMEOUT_S,
        "retry": Retry(ExponentialWithJitterBackoff(cap=BACKOFF_CAP_S, base=BACKOFF_BASE_S), RETRIES),
        "retry_on_error": [ConnectionError, TimeoutError],
        "health_check_interval": 30,
    }
    if not is_sentinel_url(url):
        return Redis.from_url(url, **options)
    return _master_for(SentinelAddress.parse(url), options)


def plain_redis(url: str, **options: object) -> Redis:
    """An asyncio client for `url` without retries, for a one-shot CLI command (`options`: redis-py's)."""
    if not is_sentinel_url(url):
        return Redis.from_url(url, **options)
    return _master_for(SentinelAddress.parse(url), options)


def sync_redis(url: str, **options: object) -> redis.Redis:
    """A blocking client for `url` (the CLI's supervisor and health probes; `options`: redis-py's)."""
    if not is_sentinel_url(url):
        return redis.Redis.from_url(url, **options)
    address = SentinelAddress.parse(url)
    sentinel_options = {"socket_timeout": SENTINEL_TIMEOUT_S, "socket_connect_timeout": SENTINEL_TIMEOUT_S}
    sentinel = redis.sentinel.Sentinel(address.sentinels, sentinel_kwargs=sentinel_options)
    return sentinel.master_for(address.master_name, connection_class=_SyncPrimaryConnection, db=address.db, **options)
