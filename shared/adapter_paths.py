"""Where adapters live under the adapter root, and how their files are opened without escaping it.

Layout: every adapter is a directory under its owner's own directory of the root,

    <adapter_root>/<owner>/<adapter ...>/adapter_config.json, adapter_model.safetensors

where the owner is a tenant or `shared` (adapters every tenant may use, registered by an admin).
A path names an adapter relative to the root (`acme/support`) or absolutely inside it.

Confinement, in two steps:
- `adapter_relative_path` checks the path as text, before the filesystem is touched: no NUL byte,
  control character or '..', bounded length, and (at registration) under the owner's directory.
  So another owner's path is refused the same way whether or not anything exists there.
- `open_adapter_dir` / `open_adapter_file` then walk it one component at a time from a descriptor
  of the root, each open relative to its parent's descriptor with O_NOFOLLOW: a symlink at any
  level (directory or file, pointing anywhere, even inside the root) is refused, and a component
  swapped for a symlink between a check and an open cannot redirect the walk, since there is no
  check apart from the open. Files must be regular with one link (a hard link could be another
  owner's file); O_NONBLOCK keeps a FIFO from blocking the open.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path, PurePosixPath

from shared.errors import ErrorCode, LorafleetError

MAX_PATH_CHARS = 1024
MAX_COMPONENT_BYTES = 255  # NAME_MAX of Linux filesystems
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def shown(text: str) -> str:
    """`text` as an error message may quote it: repr, cut to 100 characters."""
    quoted = repr(text)
    return quoted if len(quoted) <= 100 else quoted[:97] + "..."


def adapter_relative_path(adapter_root: Path, path: str, *, owner: str | None = None) -> str:
    """`path` (relative to the root, or absolute inside it) as a normalised relative path
    ('a/b', no '.' or empty components). With `owner`, it must lie under `<owner>/`."""
    if not isinstance(path, str) or not path:
        raise LorafleetError(ErrorCode.INVALID_ADAPTER_PATH, "the adapter path is empty")
    if len(path) > MAX_PATH_CHARS:
        raise LorafleetError(ErrorCode.INVALID_ADAPTER_PATH, f"the adapter path is over {MAX_PATH_CHARS} characters")
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in path):
        raise LorafleetError(ErrorCode.INVALID_ADAPTER_PATH, "the adapter path holds a NUL or control character")
    try:
        path.encode("utf-8")
    except UnicodeEncodeError as exc:  # a lone surrogate (surrogateescape'd bytes from a command line)
        raise LorafleetError(ErrorCode.INVALID_ADAPTER_PATH, "the adapter path is not valid Unicode") from exc
    parts = [part for part in path.split("/") if part not in ("", ".")]
    if ".." in parts:
        raise LorafleetError(ErrorCode.ADAPTER_PATH_OUTSIDE_ROOT, "the adapter path must not contain '..'")
    long_part = next((part for part in parts if len(part.encode()) > MAX_COMPONENT_BYTES), None)
    if long_part is not None:
        raise LorafleetError(
            ErrorCode.INVALID_ADAPTER_PATH, f"a component of the adapter path is over {MAX_COMPONENT_BYTES} bytes"
        )
    if path.startswith("/"):
        parts = _inside_root(adapter_root, parts, path)
    if owner is not None and (len(parts) < 2 or parts[0] != owner):
        raise LorafleetError(
            ErrorCode.ADAPTER_PATH_FORBIDDEN, f"adapter path {shown(path)} is not under your directory '{owner}/'"
        )
    if not parts:
        raise LorafleetError(ErrorCode.INVALID_ADAPTER_PATH, "the adapter path names the adapter root itself")
    return "/".join(parts)


def _inside_root(adapter_root: Path, parts: list[str], path: str) -> list[str]:
    """The components of absolute path `parts` below the root (as configured, or its real path)."""
    absolute = PurePosixPath("/", *parts)
    for root in (PurePosixPath(os.path.abspath(adapter_root)), PurePosixPath(os.path.realpath(adapter_root))):
        if absolute.is_relative_to(root):
            return list(absolute.relative_to(root).parts)
    raise LorafleetError(ErrorCode.ADAPTER_PATH_OUTSIDE_ROOT, f"adapter path {shown(path)} is outside the adapter root")


def open_adapter_dir(adapter_root: Path, relative_path: str) -> int:
    """A descriptor of the adapter directory `relative_path` (from adapter_relative_path), reached
    from the root without following any symlink. The caller closes it."""
    fd = os.open(adapter_root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)  # the root itself is configuration
    try:
        for part in relative_path.split("/"):
            try:
                child = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except OSError as exc:
                raise _walk_error(fd, part, relative_path, exc) from exc
            os.close(fd)
            fd = child
    except BaseException:
        os.close(fd)
        raise
    return fd


def _walk_error(parent_fd: int, part: str, relative_path: str, exc: OSError) -> LorafleetError:
    """Why `part` could not be opened as a directory, as the error to raise."""
    try:
        mode = os.lstat(part, dir_fd=parent_fd).st_mode
    except OSError:
        mode = None
    if mode is not None and stat.S_ISLNK(mode):
        return LorafleetError(
            ErrorCode.ADAPTER_SYMLINK, f"adapter path {shown(relative_path)}: {shown(part)} is a symlink"
        )
    if mode is None or exc.errno in (errno.ENOENT, errno.ENOTDIR):
        return LorafleetError(ErrorCode.ADAPTER_PATH_NOT_FOUND, f"no adapter directory at {shown(relative_path)}")
    return LorafleetError(ErrorCode.INVALID_ADAPTER, f"adapter path {shown(relative_path)}: {exc.strerror}")


def open_adapter_file(dir_fd: int, name: str) -> tuple[int, os.stat_result]:
    """A read-only descriptor of regular file `name` in adapter directory `dir_fd` and its stat;
    raises for a missing file, a symlink, anything but a regular file, or a file with several links."""
    try:
        fd = os.open(name, _FILE_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise LorafleetError(ErrorCode.ADAPTER_SYMLINK, f"{name} is a symlink") from exc
        if exc.errno == errno.ENOENT:
            raise LorafleetError(ErrorCode.ADAPTER_FILE_MISSING, f"{name} is missing{_pickle_hint(dir_fd)}") from exc
        raise LorafleetError(ErrorCode.ADAPTER_FILE_NOT_REGULAR, f"{name} cannot be opened: {exc.strerror}") from exc
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:
        os.close(fd)
        what = "not a regular file" if not stat.S_ISREG(info.st_mode) else f"a file with {info.st_nlink} hard links"
        raise LorafleetError(ErrorCode.ADAPTER_FILE_NOT_REGULAR, f"{name} is {what}")
    return fd, info


def _pickle_hint(dir_fd: int) -> str:
    try:
        pickled = sorted(name for name in os.listdir(dir_fd) if name.endswith((".bin", ".pt")))
    except OSError:  # the hint is a courtesy: an unlistable directory just gets none
        return ""
    if not pickled:
        return ""
    return f" (found {', '.join(pickled)}: pickled weights are never loaded; convert to safetensors)"
