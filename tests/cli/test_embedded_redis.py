"""The Redis `lorafleet up` runs: data survives a restart, the port is kept when free, and a server left
behind by a killed `up` is shut down rather than joined by a second one on the same files."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from cli.embedded_redis import start_embedded_redis
from cli.redis_server import RedisServer
from cli.state import FleetState


def record_url(state_dir: Path, server: RedisServer) -> None:
    """What `up` writes once its Redis runs."""
    FleetState(server.url, {}, state_dir / "adapters", "http://127.0.0.1:8000").save(state_dir)


@pytest.fixture
def servers() -> Iterator[list[RedisServer]]:
    started: list[RedisServer] = []
    yield started
    for server in started:
        server.stop()


def start(state_dir: Path, servers: list[RedisServer]) -> RedisServer:
    server = start_embedded_redis(state_dir)
    servers.append(server)
    record_url(state_dir, server)
    return server


def test_data_survives_a_restart_on_the_same_port(tmp_path: Path, servers: list[RedisServer]) -> None:
    first = start(tmp_path, servers)
    redis.Redis.from_url(first.url).set("k", "v")
    first.stop()

    second = start(tmp_path, servers)
    assert second.port == first.port
    assert redis.Redis.from_url(second.url).get("k") == b"v"
    assert (tmp_path / "redis").is_dir()


def test_a_server_left_running_by_a_killed_up_is_shut_down_first(tmp_path: Path, servers: list[RedisServer]) -> None:
    leftover = start(tmp_path, servers)
    redis.Redis.from_url(leftover.url).set("k", "v")
    leftover_pid = redis.Redis.from_url(leftover.url).info("server")["process_id"]

    replacement = start(tmp_path, servers)  # the leftover was never stopped
    assert replacement.port == leftover.port
    assert redis.Redis.from_url(replacement.url).info("server")["process_id"] != leftover_pid
    assert redis.Redis.from_url(replacement.url).get("k") == b"v"  # the leftover persisted it on shutdown


def test_a_new_port_is_taken_when_the_old_one_is_busy(tmp_path: Path, servers: list[RedisServer]) -> None:
    first = start(tmp_path, servers)
    first.stop()
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", first.port))
        squatter.listen()
        second = start(tmp_path, servers)
    assert second.port != first.port
    assert redis.Redis.from_url(second.url).ping()
