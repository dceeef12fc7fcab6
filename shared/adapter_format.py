"""Reading and validating a PEFT LoRA adapter directory, once, without torch.

An adapter is accepted only if it is a directory under the adapter root (shared/adapter_paths.py:
its owner's directory, no symlink at any level, regular files) holding `adapter_config.json`
(shared/adapter_config.py) and `adapter_model.safetensors` (never a pickle) whose tensor table is
well formed (shared/safetensors_table.py), whose tensors are exactly the LoRA matrices the config's
targets name, and whose shapes match the base model's layers at the config's rank.

`read_adapter` reads the weights file in one pass from one descriptor: the header it validates,
the bytes it hashes (shared/adapter_digest.py: the file's identity, a hash of fixed pieces) and the
data it hands back (into the caller's buffer: pinned host memory on a worker) are the same bytes,
so nothing swapped in after a check is ever hashed, validated or served. The gateway passes no
buffer: it keeps only the manifest, the data streamed through the hash piece by piece, so
registering a 2 GiB adapter does not hold 2 GiB.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Callable
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from shared.adapter_config import CONFIG_FILE, MAX_CONFIG_BYTES, AdapterConfig, parse_adapter_config
from shared.adapter_digest import combine, piece_digest, pieces
from shared.adapter_paths import adapter_relative_path, open_adapter_dir, open_adapter_file
from shared.errors import ErrorCode, LorafleetError
from shared.expert_adapter_keys import (
    FUSED_PARAMETERS,
    FusedExperts,
    check_expert_tensor,
    check_experts_complete,
    fused_parameter_of,
    parse_expert_key,
    parse_fused_key,
)
from shared.model_info import PROJECTIONS, ModelInfo
from shared.safetensors_table import TensorEntry, header_length, parse_table

__all__ = ["CONFIG_FILE", "WEIGHTS_FILE", "AdapterFiles", "AdapterManifest", "read_adapter"]

WEIGHTS_FILE = "adapter_model.safetensors"
ACCEPTED_DTYPES = frozenset({"F16", "BF16", "F32"})
# PEFT's saved names: base_model.model.model.layers.{i}.{self_attn|mlp}.{proj}.lora_{A|B}.weight
_LORA_KEY = re.compile(
    r"^base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\.("
    + "|".join(PROJECTIONS)
    + r")\.lora_([AB])\.weight$"
)


@dataclass(frozen=True, slots=True)
class AdapterManifest:
    """What validation learned about an adapter; stored in the registry beside its location."""

    rank: int
    lora_alpha: float
    use_rslora: bool
    target_modules: tuple[str, ...]  # subset of PROJECTIONS, in PROJECTIONS order, then `experts.{name}`
    size_bytes: int
    digest: str  # of adapter_model.safetensors, exactly as read (shared/adapter_digest.py)
    fused_experts: FusedExperts | None = None  # LoRAs on fused expert parameters (their own ranks)

    @property
    def serving_rank(self) -> int:
        """The slot rank the adapter needs: r, or a fused expert parameter's larger rank (gate_up: 2r)."""
        fused = self.fused_experts.ranks if self.fused_experts else ()
        return max([self.rank, *(rank for _, rank in fused)])

    @property
    def scaling(self) -> float:
        """The factor PEFT multiplies B·A·x by: alpha/r, or alpha/√r with rsLoRA."""
        return self.lora_alpha / (self.rank**0.5 if self.use_rslora else self.rank)


# (data section bytes, the validated manifest (digest not yet known), the tensor table) → a writable
# buffer of that many bytes for the data section
Allocate = Callable[[int, AdapterManifest, dict[str, TensorEntry]], memoryview]


@dataclass(frozen=True, slots=True)
class AdapterFiles:
    """An adapter read once and validated."""

    relative_path: str  # normalised, relative to the adapter root
    config: AdapterConfig
    manifest: AdapterManifest
    tensors: dict[str, TensorEntry]  # byte offsets into `data`
    header: bytes  # the weights file's first 8 + N bytes (length and JSON header)
    data: memoryview | None  # its data section, in the buffer `allocate` gave; None when none was asked for

    def weights_file(self) -> bytes:
        """The whole weights file as read (a copy), for a safetensors parser."""
        assert self.data is not None, "read without a buffer"
        return self.header + bytes(self.data)


def read_adapter(
    adapter_root: Path,
    path: str,
    model: ModelInfo,
    *,
    max_rank: int,
    max_bytes: int,
    allocate: Allocate | None = None,
    hasher: Executor | None = None,
) -> AdapterFiles:
    """Validate the adapter at `path` (relative to the root, or absolute inside it) against `model`;
    raise LorafleetError naming the first problem. The data section (everything after the header)
    goes into `allocate(n, manifest, tensors)`, a writable n-byte buffer, when given (asked for once
    the header is validated, so the caller may choose where the bytes go from what they hold); its pieces are hashed on
    `hasher`'s threads (a worker's few, shared by its loads: shared/adapter_digest.HASH_THREADS)
    while the next is read, or in turn without one."""
    relative = adapter_relative_path(adapter_root, path)
    dir_fd = open_adapter_dir(adapter_root, relative)
    try:
        config = parse_adapter_config(_read_config(dir_fd))
        if config.max_rank > max_rank:
            raise LorafleetError(
                ErrorCode.ADAPTER_RANK_TOO_LARGE,
                f"rank {str(config.max_rank)[:20]} exceeds the maximum rank {max_rank}",
            )
        fd, stat = open_adapter_file(dir_fd, WEIGHTS_FILE)
    finally:
        os.close(dir_fd)
    with os.fdopen(fd, "rb", buffering=0) as f:
        if stat.st_size > max_bytes:
            raise LorafleetError(
                ErrorCode.ADAPTER_TOO_LARGE, f"{WEIGHTS_FILE} is {stat.st_size} bytes, over the limit of {max_bytes}"
            )
        try:
            prefix = _read_exact(f, 8)
            header = prefix + _read_exact(f, header_length(prefix, stat.st_size, WEIGHTS_FILE))
            tensors = parse_table(header[8:], stat.st_size - len(header), WEIGHTS_FILE)
            manifest = _manifest(config, tensors, model, size=stat.st_size)  # before the data: fail fast
            allocate_data = None if allocate is None else lambda n: allocate(n, manifest, tensors)
            data, digest = _read_data(f, header, stat.st_size - len(header), allocate_data, hasher)
        except OSError as exc:
            raise _read_failed(WEIGHTS_FILE, f, exc) from exc
    manifest = dataclasses.replace(manifest, digest=digest)
    return AdapterFiles(relative, config, manifest, tensors, header, data)


def _read_config(dir_fd: int) -> bytes:
    fd, stat = open_adapter_file(dir_fd, CONFIG_FILE)
    with os.fdopen(fd, "rb", buffering=0) as f:
        if stat.st_size > MAX_CONFIG_BYTES:
            raise LorafleetError(
                ErrorCode.INVALID_ADAPTER_CONFIG, f"{CONFIG_FILE} is over the limit of {MAX_CONFIG_BYTES} bytes"
            )
        try:
            raw = f.read(MAX_CONFIG_BYTES + 1)
        except OSError as exc:
            raise _read_failed(CONFIG_FILE, f, exc) from exc
    if len(raw) > MAX_CONFIG_BYTES:  # grown since the size check
        raise LorafleetError(ErrorCode.INVALID_ADAPTER_CONFIG, f"{CONFIG_FILE} changed while it was read")
    return raw


def _read_failed(name: str, f: BinaryIO, exc: OSError) -> LorafleetError:
    """A disk error reading `name`: the disk's fault, not the adapter's; this read fails, nothing else."""
    return LorafleetError(ErrorCode.INTERNAL_ERROR, f"{name}: read failed at byte {f.tell()} ({exc.strerror or exc})")


def _read_exact(f: BinaryIO, n: int) -> bytes:
    chunks, left = [], n
    while left:
        chunk = f.read(left)
        if not chunk:
            raise LorafleetError(ErrorCode.INVALID_SAFETENSORS, f"{WEIGHTS_FILE} changed while it was read")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _read_data(
    f: BinaryIO, header: bytes, n: int, allocate: Callable[[int], memoryview] | None, hasher: Executor | None
) -> tuple[memoryview | None, str]:
    """The file's next `n` bytes (and no more: the file must end there) into `allocate(n)`, or only
    through the hash without a buffer, with the identity of the whole file (`header` + those bytes).
    Into a buffer with a `hasher`, each piece is hashed on its threads while the next is read, so a
    load takes about as long as its read; otherwise (registration) pieces are hashed in turn."""
    if allocate is None:
        digests = [
            piece_digest(header[start:end], _read_exact(f, max(end - len(header), 0) - max(start - len(header), 0)))
            for start, end in pieces(len(header) + n)
        ]
        _check_ended(f)
        return None, combine(digests)
    buffer = allocate(n)
    hashed: list[Future[bytes]] = []
    try:
        for start, end in pieces(len(header) + n):
            # a piece is the header's bytes in [start, end), then the data's (data offset = file offset - header)
            low, high = max(start - len(header), 0), max(end - len(header), 0)
            _read_into(f, buffer[low:high])
            if hasher is None:
                hashed.append(_done(piece_digest(header[start:end], buffer[low:high])))
            else:
                hashed.append(hasher.submit(piece_digest, header[start:end], buffer[low:high]))
        _check_ended(f)
    except BaseException:
        for piece in hashed:
            piece.cancel()  # the load failed: its pieces not hashed yet are not worth a thread
        raise
    return buffer, combine(piece.result() for piece in hashed)


def _done(digest: bytes) -> Future[bytes]:
    future: Future[bytes] = Future()
    future.set_result(digest)
    return future


def _read_into(f: BinaryIO, target: memoryview) -> None:
    done = 0
    while done < len(target):
        read = f.readinto(target[done:]) or 0
        if not read:
            raise LorafleetError(ErrorCode.INVALID_SAFETENSORS, f"{WEIGHTS_FILE} changed while it was read")
        done += read


def _check_ended(f: BinaryIO) -> None:
    if f.read(1):
        raise LorafleetError(ErrorCode.INVALID_SAFETENSORS, f"{WEIGHTS_FILE} changed while it was read")


def _manifest(
    config: AdapterConfig, tensors: dict[str, TensorEntry], model: ModelInfo, *, size: int
) -> AdapterManifest:
    """Check every tensor against `model`, the config's rank and its targets (digest left empty)."""
    rank = config.rank
    seen: dict[tuple[int, str], set[str]] = {}
    experts_seen: dict[tuple[int, str], set[int]] = {}
    dense: set[str] = set()  # projections with a dense LoRA
    modules: set[str] = set()  # dense and per-expert module names, as target_modules names them
    fused = config.fused_experts
    for name, entry in tensors.items():
        fused_key = parse_fused_key(name, model) if fused else None
        if fused and fused_key is not None:
            if fused_key.layer not in model.moe_layers:
                raise LorafleetError(
                    ErrorCode.ADAPTER_SHAPE_MISMATCH, f"{name}: layer {fused_key.layer} has no experts"
                )
            _check_dtype(name, entry)
            parameter = fused_parameter_of(list(entry.shape), fused_key, fused, model)
            # an A and a B pair up when they sit in the same wrapper and fit the same parameter
            seen.setdefault((fused_key.layer, f"experts.{fused_key.wrapper}{parameter}"), set()).add(fused_key.which)
            experts_seen.setdefault((fused_key.layer, parameter), set()).add(-1)
            continue
        expert = parse_expert_key(name, model)
        if expert is not None:
            _check_dtype(name, entry)
            check_expert_tensor(name, expert, list(entry.shape), model, rank)
            seen.setdefault((expert.layer, f"experts.{expert.expert}.{expert.projection}"), set()).add(expert.which)
            experts_seen.setdefault((expert.layer, expert.projection), set()).add(expert.expert)
            modules.add(expert.projection)
            continue
        match = _LORA_KEY.match(name)
        if match is None:
            raise LorafleetError(
                ErrorCode.ADAPTER_UNSUPPORTED, f"tensor {name[:200]!r} is not a LoRA A/B matrix of a decoder projection"
            )
        layer, projection, which = int(match[1]), match[2], match[3]
        if layer >= model.num_layers:
            raise LorafleetError(
                ErrorCode.ADAPTER_SHAPE_MISMATCH, f"{name}: the base model has {model.num_layers} layers"
            )
        if layer in model.moe_layers and projection in ("gate_proj", "up_proj", "down_proj"):
            raise LorafleetError(
                ErrorCode.ADAPTER_SHAPE_MISMATCH, f"{name}: layer {layer}'s MLP is a mixture of experts"
            )
        _check_dtype(name, entry)
        in_features, out_features = model.projection_shape(projection)
        expected = (rank, in_features) if which == "A" else (out_features, rank)
        if entry.shape != expected:
            raise LorafleetError(
                ErrorCode.ADAPTER_SHAPE_MISMATCH,
                f"{name}: shape {list(entry.shape)} does not match the base model's {list(expected)}",
            )
        seen.setdefault((layer, projection), set()).add(which)
        dense.add(projection)
        modules.add(projection)
    if not seen:
        raise LorafleetError(ErrorCode.INVALID_ADAPTER, f"{WEIGHTS_FILE} holds no LoRA matrices")
    unpaired = sorted(f"layers.{layer}.{proj}" for (layer, proj), parts in seen.items() if parts != {"A", "B"})
    if unpaired:
        raise LorafleetError(
            ErrorCode.INVALID_ADAPTER, f"LoRA A without B (or B without A) at {', '.join(unpaired[:3])}"
        )
    if fused:
        expert_targets = tuple(f"experts.{p}" for p in FUSED_PARAMETERS if any(p == q for _, q in experts_seen))
    else:
        expert_targets = check_experts_complete(experts_seen, model)
    _check_targets(config, modules, {p for _, p in experts_seen} if fused else set())
    return AdapterManifest(
        rank=rank,
        lora_alpha=config.lora_alpha,
        use_rslora=config.use_rslora,
        target_modules=tuple(p for p in PROJECTIONS if p in dense) + expert_targets,
        size_bytes=size,
        digest="",
        fused_experts=fused,
    )


def _check_dtype(name: str, entry: TensorEntry) -> None:
    if entry.dtype not in ACCEPTED_DTYPES:
        raise LorafleetError(
            ErrorCode.ADAPTER_DTYPE_UNSUPPORTED, f"{name}: dtype {entry.dtype} is not F16, BF16 or F32"
        )


def _check_targets(config: AdapterConfig, modules: set[str], parameters: set[str]) -> None:
    """The weights adapt exactly the modules (and fused parameters) the config says they do: PEFT
    would apply the config's targets, so any disagreement means the file is not what it claims."""
    for field, declared, found in (
        ("target_modules", config.target_modules, modules),
        ("target_parameters", config.target_parameters, parameters),
    ):
        if declared != found:
            missing, extra = sorted(declared - found), sorted(found - declared)
            detail = "; ".join(
                part
                for part in (
                    f"no LoRA matrices for {', '.join(missing)}" if missing else "",
                    f"LoRA matrices for {', '.join(extra)}, which it does not list" if extra else "",
                )
                if part
            )
            raise LorafleetError(ErrorCode.ADAPTER_CONFIG_MISMATCH, f"{CONFIG_FILE} {field}: {detail}"[:300])
