"""An adapter read from disk on the worker's path (read_host_adapter, its pieces hashed on threads)
when the disk misbehaves: short reads are resumed; a file that grows, shrinks or changes under the
reader, or a read that fails mid-file, fails that load alone with ADAPTER_LOAD_FAILED saying what
happened, and the next load of the same adapter, once the file is whole again, succeeds."""

from __future__ import annotations

import errno
import os
import re
from collections.abc import Callable
from pathlib import Path

import pytest

from shared import adapter_digest
from shared.adapter_format import CONFIG_FILE, WEIGHTS_FILE
from shared.errors import ErrorCode, LorafleetError
from tests.gateway.fleet import tiny_model
from tests.shared.hostile_adapters import Lab, piece_digest_of
from tests.worker.test_hostile_adapter_load import load as load_as_the_pool
from worker.adapter_pool.host_adapter import HostAdapter

MODEL = tiny_model("tiny")
PIECE = 64  # bytes: the test adapter's file (~330 bytes) is read in several pieces


class WeightsFile:
    """An adapter's file as the reader sees it, with `before_read(call)` run before each of its
    `readinto` or `read` calls (0, 1, …): the reads the test interferes with."""

    def __init__(self, file, before_read: Callable[[int], None], max_bytes: int | None) -> None:
        self._file, self._before_read, self._max_bytes = file, before_read, max_bytes
        self.calls = 0

    def readinto(self, buffer: memoryview) -> int:
        self._before_read(self.calls)
        self.calls += 1
        return self._file.readinto(buffer if self._max_bytes is None else buffer[: self._max_bytes])

    def read(self, size: int = -1) -> bytes:
        self._before_read(self.calls)
        self.calls += 1
        return self._file.read(size)

    def __getattr__(self, name: str):
        return getattr(self._file, name)

    def __enter__(self) -> WeightsFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self._file.close()


@pytest.fixture
def lab(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Lab:
    monkeypatch.setattr(adapter_digest, "PIECE_BYTES", PIECE)
    return Lab(tmp_path / "adapters", tmp_path / "outside", MODEL)


def interfere(
    monkeypatch: pytest.MonkeyPatch,
    before_read: Callable[[int], None] = lambda call: None,
    *,
    max_bytes=None,
    name: str = WEIGHTS_FILE,
) -> list[WeightsFile]:
    """From now on, the adapter's file `name` opens through WeightsFile; returns those opened."""
    real_fdopen = os.fdopen
    opened: list[WeightsFile] = []

    def fdopen(fd: int, *args, **kwargs):
        file = real_fdopen(fd, *args, **kwargs)
        if os.readlink(f"/proc/self/fd/{fd}").endswith(name):
            opened.append(WeightsFile(file, before_read, max_bytes))
            return opened[-1]
        return file

    monkeypatch.setattr(os, "fdopen", fdopen)
    return opened


def load(lab: Lab, directory: Path, digest: str) -> HostAdapter:
    return load_as_the_pool(lab, lab.rel(directory), digest)


def registered(lab: Lab) -> tuple[Path, str, bytes]:
    directory = lab.valid()
    content = (directory / WEIGHTS_FILE).read_bytes()
    return directory, piece_digest_of(content, PIECE), content


def data_of(content: bytes) -> bytes:
    return content[8 + int.from_bytes(content[:8], "little") :]


def test_short_reads_are_resumed_and_serve_the_whole_file(lab: Lab, monkeypatch: pytest.MonkeyPatch):
    directory, digest, content = registered(lab)
    opened = interfere(monkeypatch, max_bytes=7)

    adapter = load(lab, directory, digest)
    assert adapter.buffer.numpy().tobytes() == data_of(content)
    assert opened[0].calls > len(data_of(content)) // 7


def rewrite(path: Path, content: bytes) -> Callable[[int], None]:
    """Before the first reader's third read: the file's contents become `content` (same inode)."""
    done = []

    def before_read(call: int) -> None:
        if call == 2 and not done:
            done.append(call)
            with path.open("r+b") as f:
                f.write(content)
                f.truncate(len(content))

    return before_read


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (lambda content: content + b"\0" * 100, "changed while it was read"),
        (lambda content: content[:-100], "changed while it was read"),
        (lambda content: content[:-4] + bytes(4), "changed since registration"),
    ],
    ids=["grows", "shrinks", "rewritten, same size"],
)
def test_a_file_changed_under_the_reader_fails_that_load(lab: Lab, monkeypatch: pytest.MonkeyPatch, change, reason):
    directory, digest, content = registered(lab)
    interfere(monkeypatch, rewrite(directory / WEIGHTS_FILE, change(content)))

    with pytest.raises(LorafleetError, match=reason) as failed:
        load(lab, directory, digest)
    assert failed.value.code is ErrorCode.ADAPTER_LOAD_FAILED
    (directory / WEIGHTS_FILE).write_bytes(content)  # whole again: the next load serves it
    assert load(lab, directory, digest).buffer.numpy().tobytes() == data_of(content)


@pytest.mark.parametrize(("name", "failing_read"), [(WEIGHTS_FILE, 2), (CONFIG_FILE, 0)])
def test_a_disk_error_mid_read_fails_that_load_naming_the_file_and_the_error(
    lab: Lab, monkeypatch: pytest.MonkeyPatch, name: str, failing_read: int
):
    directory, digest, content = registered(lab)

    def read_fails(call: int) -> None:
        if call == failing_read:
            raise OSError(errno.EIO, os.strerror(errno.EIO))

    interfere(monkeypatch, read_fails, name=name)
    with pytest.raises(
        LorafleetError, match=rf"{re.escape(name)}: read failed at byte \d+ \(Input/output error\)"
    ) as failed:
        load(lab, directory, digest)
    assert failed.value.code is ErrorCode.ADAPTER_LOAD_FAILED
    monkeypatch.undo()
    monkeypatch.setattr(adapter_digest, "PIECE_BYTES", PIECE)
    assert load(lab, directory, digest).buffer.numpy().tobytes() == data_of(content)
