"""Where Redis is, from flags: a plain URL or a primary named by its Sentinels, and how new jobs and
results wait for replicas."""

from __future__ import annotations

import pytest

from cli import config_from_args as cfa
from cli.main import build_parser
from shared.config import ReplicaWait
from shared.redis_client import SentinelAddress, check_redis_url

SENTINELS = "10.0.0.1:26379,10.0.0.2:26379,sentinel-3:26380"


def parse(*args: str):
    return build_parser().parse_args(list(args))


def test_sentinel_flags_become_one_url_that_reads_back_as_the_same_address():
    url = cfa.redis_url(parse("tenant", "create", "t", "--redis-sentinel", SENTINELS, "--redis-master-name", "main"))
    address = SentinelAddress.parse(url)
    assert address.sentinels == (("10.0.0.1", 26379), ("10.0.0.2", 26379), ("sentinel-3", 26380))
    assert address.master_name == "main"
    assert SentinelAddress.parse(address.url) == address


@pytest.mark.parametrize(
    "flags",
    [
        ["--redis-sentinel", SENTINELS],  # no master name
        ["--redis-master-name", "main"],  # no Sentinels
        ["--redis-sentinel", "10.0.0.1", "--redis-master-name", "main"],  # no port
        ["--redis-sentinel", SENTINELS, "--redis-master-name", "main", "--redis-url", "redis://x:1"],
    ],
)
def test_incomplete_or_contradictory_sentinel_flags_are_refused(flags):
    with pytest.raises(cfa.ConfigError):
        cfa.redis_url(parse("tenant", "create", "t", *flags))


@pytest.mark.parametrize("url", ["http://x:1", "redis+sentinel://x/main", "redis+sentinel://x:1/", "x:6379"])
def test_malformed_redis_urls_are_refused(url):
    with pytest.raises(ValueError):
        check_redis_url(url)


def test_gateway_and_worker_wait_for_the_replicas_they_are_told(tmp_path):
    flags = ["--redis-url", "redis://127.0.0.1:1/0", "--redis-wait-replicas", "1", "--redis-wait-timeout-ms", "250"]
    assert cfa.gateway_config(parse("gateway", *flags)).replica_wait == ReplicaWait(1, 250)
    (tmp_path / "config.json").write_text("{}")
    worker = parse("worker", *flags, "--adapter-root", str(tmp_path), "--model", f"m={tmp_path}", "--device", "cpu")
    assert cfa.worker_config(worker).replica_wait == ReplicaWait(1, 250)
    assert cfa.gateway_config(parse("gateway", "--redis-url", "redis://h:1/0")).replica_wait == ReplicaWait(0, 1000)


def test_up_starts_replicas_only_beside_its_own_redis():
    with pytest.raises(cfa.ConfigError):
        cfa.up_config(parse("up", "--redis-url", "redis://h:1/0", "--redis-replicas", "1", "--device", "cpu"))
