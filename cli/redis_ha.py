"""A Redis without a single point of failure on one machine, for trying it out: a primary, N replicas
and three Sentinels, each a child process on a free loopback port (`lorafleet up --redis-replicas N`,
and the failover tests).

Clients reach it by `url` (`redis+sentinel://...`, shared/redis_client.py). Every server may become
the primary, so all get the same settings. The Sentinels are told of each other and of the replicas
in their configuration files, so they agree on a failover at once instead of discovering each
other over the first seconds. It is a trial setup: production runs each on its own machine
(deploy/README.md).
"""

from __future__ import annotations

import secrets
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import redis
import structlog

from cli.parent_death import die_with_parent
from cli.redis_server import RedisServer, RedisServerError, find_redis_server, free_port
from shared.redis_client import SentinelAddress

log = structlog.get_logger(__name__)

MASTER_NAME = "lorafleet"
SENTINELS = 3
QUORUM = 2  # Sentinels that must agree the primary is down; a majority of them also elects the leader
_LOOPBACK = "127.0.0.1"
# a replica's first sync starts at once, not after the default 5 s of waiting for more replicas to join
_SERVER_ARGS = ("--repl-diskless-sync-delay", "0")


@dataclass(frozen=True, slots=True)
class FailoverTiming:
    """How fast the Sentinels act: a primary silent for `down_after_ms` is down; a failover that has not
    completed within `failover_timeout_ms` is tried again (by then by another Sentinel)."""

    down_after_ms: int = 5000
    failover_timeout_ms: int = 60_000


class _Sentinel:
    """One `redis-server --sentinel` child; it rewrites its configuration file as the fleet changes."""

    def __init__(self, data_dir: Path, port: int, config: str) -> None:
        self.data_dir = data_dir
        self.port = port
        self._config = config
        self._process: subprocess.Popen | None = None

    def start(self) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        config_file = self.data_dir / "sentinel.conf"
        config_file.write_text(self._config)
        with (self.data_dir / "sentinel.log").open("ab") as log_file:
            self._process = subprocess.Popen(
                [find_redis_server(), str(config_file), "--sentinel"],
                stdout=log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=die_with_parent(),
            )

    def client(self) -> redis.Redis:
        return redis.Redis(host=_LOOPBACK, port=self.port, socket_timeout=1.0, socket_connect_timeout=1.0)

    def stop(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.terminate()
            self._process.wait()


class RedisHA:
    """A primary, `replicas` replicas and three Sentinels, in directories under `data_dir`."""

    def __init__(
        self, data_dir: Path, replicas: int, *, timing: FailoverTiming | None = None, append_only: bool = True
    ) -> None:
        if replicas < 1:
            raise ValueError("a Redis without a single point of failure needs at least one replica")
        self._append_only = append_only
        self.primary = RedisServer(data_dir / "primary", append_only=append_only, extra_args=_SERVER_ARGS)
        self.replicas = [
            self._replica(data_dir / f"replica-{index}", free_port(), self.primary.port)
            for index in range(1, replicas + 1)
        ]
        self._data_dir = data_dir
        timing = timing or FailoverTiming()
        ports = [free_port() for _ in range(SENTINELS)]
        ids = [secrets.token_hex(20) for _ in range(SENTINELS)]
        self.sentinels = [
            _Sentinel(self._sentinel_dir(index), port, self._sentinel_config(port, ids, ports, index, timing))
            for index, port in enumerate(ports)
        ]

    @property
    def url(self) -> str:
        return SentinelAddress(tuple((_LOOPBACK, s.port) for s in self.sentinels), MASTER_NAME).url

    def start(self, timeout_s: float = 30.0) -> None:
        """Start every server and Sentinel; return once the replicas are in sync and the Sentinels see them."""
        try:
            self.primary.start()
            for replica in self.replicas:
                replica.start()
            for sentinel in self.sentinels:
                sentinel.start()
            self._wait_until_watched(time.monotonic() + timeout_s)
        except BaseException:
            self.stop()
            raise
        log.info("redis_ha_started", url=self.url, primary=self.primary.port, replicas=len(self.replicas))

    def stop(self) -> None:
        """Sentinels first (so they start no failover), then the servers."""
        for sentinel in self.sentinels:
            sentinel.stop()
        for server in [*self.replicas, self.primary]:
            server.stop()

    def primary_port(self) -> int:
        """The port of the primary the Sentinels name now (RedisServerError when none answers)."""
        for sentinel in self.sentinels:
            try:
                with sentinel.client() as client:
                    address = client.sentinel_get_master_addr_by_name(MASTER_NAME)
            except redis.RedisError:
                continue
            if address:
                return int(address[1])
        raise RedisServerError("no Sentinel names a primary")

    def server_on(self, port: int) -> RedisServer:
        return next(server for server in [self.primary, *self.replicas] if server.port == port)

    def rejoin(self, server: RedisServer) -> RedisServer:
        """Start a stopped server again on its port as a replica of the primary the Sentinels name now (as
        an operator brings back a failed primary: the Sentinels would demote it too, but only after their
        next 10 s look at it). Returns the new server, which takes the old one's place."""
        replica = self._replica(server.data_dir, server.port, self.primary_port())
        replica.start()
        if server is self.primary:
            self.primary = replica
        else:
            self.replicas[self.replicas.index(server)] = replica
        return replica

    def _replica(self, data_dir: Path, port: int, primary_port: int) -> RedisServer:
        replica_of = ("--replicaof", _LOOPBACK, str(primary_port))
        return RedisServer(data_dir, port=port, append_only=self._append_only, extra_args=_SERVER_ARGS + replica_of)

    def _sentinel_config(self, port: int, ids: list[str], ports: list[int], index: int, timing: FailoverTiming) -> str:
        lines = [
            f"port {port}",
            f"bind {_LOOPBACK}",
            f"dir {self._sentinel_dir(index)}",
            f"sentinel myid {ids[index]}",
            f"sentinel monitor {MASTER_NAME} {_LOOPBACK} {self.primary.port} {QUORUM}",
            f"sentinel down-after-milliseconds {MASTER_NAME} {timing.down_after_ms}",
            f"sentinel failover-timeout {MASTER_NAME} {timing.failover_timeout_ms}",
            f"sentinel parallel-syncs {MASTER_NAME} 1",
        ]
        lines += [f"sentinel known-replica {MASTER_NAME} {_LOOPBACK} {replica.port}" for replica in self.replicas]
        lines += [
            f"sentinel known-sentinel {MASTER_NAME} {_LOOPBACK} {other_port} {other_id}"
            for other_port, other_id in zip(ports, ids, strict=True)
            if other_port != port
        ]
        return "\n".join(lines) + "\n"

    def _sentinel_dir(self, index: int) -> Path:
        return self._data_dir / f"sentinel-{index + 1}"

    def _wait_until_watched(self, deadline: float) -> None:
        with redis.Redis(host=_LOOPBACK, port=self.primary.port) as primary:
            while True:
                info = primary.info("replication")
                online = sum(
                    1 for key, value in info.items() if key.startswith("slave") and value.get("state") == "online"
                )
                if online == len(self.replicas) and all(self._sees_everything(s) for s in self.sentinels):
                    return
                if time.monotonic() > deadline:
                    raise RedisServerError(
                        f"{online} of {len(self.replicas)} replicas in sync, or a Sentinel not ready; "
                        f"see the logs under {self._data_dir}"
                    )
                time.sleep(0.05)

    def _sees_everything(self, sentinel: _Sentinel) -> bool:
        try:
            with sentinel.client() as client:
                master = client.sentinel_master(MASTER_NAME)
                return int(master["num-slaves"]) == len(self.replicas) and int(master["num-other-sentinels"]) == 2
        except (redis.RedisError, KeyError):
            return False


def start_redis_ha(state_dir: Path, replicas: int) -> RedisHA:
    """The primary, replicas and Sentinels of `lorafleet up --redis-replicas N`, data in STATE_DIR/redis-ha."""
    ha = RedisHA(state_dir / "redis-ha", replicas)
    ha.start()
    return ha
