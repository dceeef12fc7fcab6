"""An HF checkpoint's tensors (safetensors only, single file or sharded) into a model's parameters.

The model says where each checkpoint tensor goes (a loader per tensor name, declared by the layer
that owns the parameter); this module finds the files and holds the loading strict: a tensor the
model has no place for, or a parameter no tensor filled, is an error naming it. Pickled checkpoints
(`*.bin`, `*.pt`) are never read. The files themselves are read into host memory by
worker/switching/loader.py, the one way weights reach a model.
"""

from __future__ import annotations

import contextlib
import json
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from contextvars import ContextVar
from pathlib import Path

import torch

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

TensorLoader = Callable[[torch.Tensor], None]


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a checkpoint: the shards its index names, or the single file."""
    model_dir = Path(model_dir)
    index = model_dir / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [model_dir / shard for shard in sorted(set(weight_map.values()))]
    single = model_dir / SINGLE_FILE
    if single.is_file():
        return [single]
    pickled = sorted(p.name for pattern in ("*.bin", "*.pt", "*.pth") for p in model_dir.glob(pattern))
    hint = f" (found {', '.join(pickled)}: pickled weights are never loaded; convert to safetensors)" if pickled else ""
    raise FileNotFoundError(f"{model_dir}: neither {SINGLE_FILE} nor {INDEX_FILE}{hint}")


# Host-to-device copies go in pieces of at most this many bytes, and a paced load (`paced_copies`)
# keeps at most _PIECES_IN_FLIGHT of them queued: copies queue on the GPU's copy engine in order, so
# a serving model's small per-step input copy waits behind two pieces (about a millisecond) of a
# model being loaded beside it, not behind the whole model (unpaced, a serving model's decode fell
# tenfold while an 8B model was copied: docs/benchmarks.md, "Figures behind code comments").
COPY_CHUNK_BYTES = 32 << 20
_PIECES_IN_FLIGHT = 2


class _CopyPacer:
    """Marks the current stream every COPY_CHUNK_BYTES queued and waits for the mark _PIECES_IN_FLIGHT
    back, so the host never runs ahead of the copy engine by more than that."""

    def __init__(self) -> None:
        self._queued = 0
        self._marks: deque[torch.cuda.Event] = deque()

    def queued(self, nbytes: int) -> None:
        self._queued += nbytes
        if self._queued < COPY_CHUNK_BYTES:
            return
        self._queued = 0
        mark = torch.cuda.Event()
        mark.record()
        self._marks.append(mark)
        if len(self._marks) > _PIECES_IN_FLIGHT:
            self._marks.popleft().synchronize()


_pacer: ContextVar[_CopyPacer | None] = ContextVar("copy_pacer", default=None)


@contextlib.contextmanager
def paced_copies() -> Iterator[None]:
    """Within this block (on this thread), copy_weight paces its host-to-device copies on the current
    CUDA stream: for loading a model beside one that serves."""
    token = _pacer.set(_CopyPacer())
    try:
        yield
    finally:
        _pacer.reset(token)


def copy_weight(target: torch.Tensor, tensor: torch.Tensor, *, name: str) -> None:
    """Copy a checkpoint tensor into a parameter (or a slice of one), converting its dtype.

    Asynchronous from pinned host memory (the caller synchronises the stream before the weights are
    used, and keeps the host tensors alive until then); from pageable memory torch copies synchronously."""
    if target.shape != tensor.shape:
        raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model shape {tuple(target.shape)}")
    pacer = _pacer.get()
    row_bytes = tensor[0].numel() * tensor.element_size() if tensor.dim() > 1 and len(tensor) else 0
    if not row_bytes or len(tensor) * row_bytes <= COPY_CHUNK_BYTES:
        target.copy_(tensor, non_blocking=True)
        if pacer is not None:
            pacer.queued(tensor.numel() * tensor.element_size())
        return
    rows = max(1, COPY_CHUNK_BYTES // row_bytes)
    for piece, source in zip(target.split(rows), tensor.split(rows), strict=True):
        piece.copy_(source, non_blocking=True)
        if pacer is not None:
            pacer.queued(source.numel() * source.element_size())


def load_tensors(
    tensors: Iterable[tuple[str, torch.Tensor]],
    loaders: dict[str, TensorLoader],
    *,
    ignore: Callable[[str], bool],
    source: str,
) -> None:
    """Feed (checkpoint name, tensor) pairs, read from disk or held in host memory, to their loaders,
    strictly: every loader filled once, no tensor without a loader. `source` names them in errors."""
    pending = dict(loaders)
    for name, tensor in tensors:
        if ignore(name):
            continue
        loader = pending.pop(name, None)
        if loader is None:
            reason = "given twice" if name in loaders else "not a parameter of this model"
            raise ValueError(f"{source}: checkpoint tensor {name!r} is {reason}")
        try:
            loader(tensor)
        except ValueError as exc:  # the loaders name the tensor; the error names the checkpoint too
            raise ValueError(f"{source}: {exc}") from exc
    if pending:
        missing = sorted(pending)
        raise ValueError(f"{source}: checkpoint lacks {len(missing)} tensors: {', '.join(missing[:5])}")
