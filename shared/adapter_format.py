"""Validation of PEFT LoRA adapter directories, without torch.

An adapter is accepted only if it is a directory under the adapter root holding
`adapter_config.json` and `adapter_model.safetensors` (never a pickle), whose LoRA matrices match
the base model's layers exactly. Each refusal carries an error code naming the problem.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from shared.errors import ErrorCode, LorafleetError
from shared.expert_adapter_keys import (
    FUSED_PARAMETERS,
    FusedExperts,
    check_expert_tensor,
    check_experts_complete,
    fused_experts,
    fused_parameter_of,
    parse_expert_key,
    parse_fused_key,
)
from shared.model_info import PROJECTIONS, ModelInfo

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_ACCEPTED_DTYPES = {"F16", "BF16", "F32"}
_MAX_HEADER_BYTES = 64 << 20
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
    sha256: str  # of adapter_model.safetensors
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


def _invalid(code: ErrorCode, message: str) -> LorafleetError:
    return LorafleetError(code, message)


def resolve_adapter_dir(adapter_root: Path, path: str | Path) -> Path:
    """The adapter directory `path` (relative to the root, or absolute inside it), resolved.

    Refuses `..` components and anything whose real path (after symlinks) leaves the root.
    """
    candidate = Path(path)
    if ".." in candidate.parts:
        raise _invalid(ErrorCode.ADAPTER_PATH_OUTSIDE_ROOT, "adapter path must not contain '..'")
    root = Path(adapter_root).resolve()
    full = candidate if candidate.is_absolute() else root / candidate
    resolved = full.resolve()
    if not resolved.is_relative_to(root):
        raise _invalid(ErrorCode.ADAPTER_PATH_OUTSIDE_ROOT, f"adapter path {str(path)!r} is outside the adapter root")
    if not resolved.is_dir():
        raise _invalid(ErrorCode.INVALID_ADAPTER, f"adapter path {str(path)!r} is not a directory")
    return resolved


def read_safetensors_header(path: Path) -> dict[str, dict]:
    """The tensor table of a safetensors file: name → {dtype, shape, data_offsets}."""
    with path.open("rb") as f:
        return _parse_header(f.read, path.name)


def _parse_header(read: Callable[[int], bytes], file_name: str) -> dict[str, dict]:
    """The tensor table from `read` positioned at the start of a safetensors file."""
    prefix = read(8)
    if len(prefix) != 8:
        raise _invalid(ErrorCode.INVALID_ADAPTER, f"{file_name} is not a safetensors file")
    (header_len,) = struct.unpack("<Q", prefix)
    if header_len > _MAX_HEADER_BYTES:
        raise _invalid(ErrorCode.INVALID_ADAPTER, f"{file_name}: safetensors header too large")
    try:
        header = json.loads(read(header_len))
    except ValueError as exc:
        raise _invalid(ErrorCode.INVALID_ADAPTER, f"{file_name}: unreadable safetensors header") from exc
    if not isinstance(header, dict):
        raise _invalid(ErrorCode.INVALID_ADAPTER, f"{file_name}: unreadable safetensors header")
    header.pop("__metadata__", None)
    return header


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _read_config(adapter_dir: Path) -> dict:
    config_path = adapter_dir / CONFIG_FILE
    if not config_path.is_file():
        raise _invalid(ErrorCode.INVALID_ADAPTER, f"{CONFIG_FILE} is missing")
    try:
        config = json.loads(config_path.read_text())
    except ValueError as exc:
        raise _invalid(ErrorCode.INVALID_ADAPTER, f"{CONFIG_FILE} is not valid JSON") from exc
    if not isinstance(config, dict):
        raise _invalid(ErrorCode.INVALID_ADAPTER, f"{CONFIG_FILE} must hold a JSON object")
    if config.get("peft_type") != "LORA":
        raise _invalid(ErrorCode.ADAPTER_UNSUPPORTED, f"peft_type {config.get('peft_type')!r} is not LORA")
    unsupported = {
        "use_dora": bool(config.get("use_dora")),
        "modules_to_save": bool(config.get("modules_to_save")),
        # PEFT writes rank/alpha patterns for the fused expert parameters (checked by fused_experts)
        "rank_pattern": bool(config.get("rank_pattern")) and not config.get("target_parameters"),
        "alpha_pattern": bool(config.get("alpha_pattern")) and not config.get("target_parameters"),
        "fan_in_fan_out": bool(config.get("fan_in_fan_out")),
        "bias": config.get("bias", "none") != "none",
    }
    refused = [name for name, present in unsupported.items() if present]
    if refused:
        raise _invalid(ErrorCode.ADAPTER_UNSUPPORTED, f"unsupported PEFT features: {', '.join(refused)}")
    if not isinstance(config.get("r"), int) or config["r"] < 1:
        raise _invalid(ErrorCode.INVALID_ADAPTER, "adapter_config.json: r must be a positive integer")
    fused_experts(config)  # raises unless any target_parameters are MoE experts' fused parameters
    return config


def inspect_adapter(adapter_dir: Path, model: ModelInfo, *, max_rank: int, max_bytes: int) -> AdapterManifest:
    """Validate an adapter directory against `model`; raise LorafleetError naming the first problem."""
    config = _read_config(adapter_dir)
    _check_rank(config, max_rank)
    weights = _weights_file(adapter_dir, max_bytes)
    header = read_safetensors_header(weights)
    return _manifest(config, header, model, size=weights.stat().st_size, sha256=file_sha256(weights))


def read_adapter_files(adapter_dir: Path, *, max_rank: int, max_bytes: int) -> tuple[dict, bytes]:
    """An adapter directory's config and weights file bytes, read once (rank, size and safetensors-only
    checked); `manifest_of` validates the bytes themselves, so a file replaced meanwhile cannot slip in."""
    config = _read_config(adapter_dir)
    _check_rank(config, max_rank)
    data = _weights_file(adapter_dir, max_bytes).read_bytes()
    if len(data) > max_bytes:  # grown since the size check
        raise _invalid(ErrorCode.ADAPTER_TOO_LARGE, f"{WEIGHTS_FILE} is over the limit of {max_bytes} bytes")
    return config, data


def read_adapter_into(
    adapter_dir: Path, model: ModelInfo, *, max_rank: int, max_bytes: int, allocate: Callable[[int], memoryview]
) -> tuple[AdapterManifest, dict[str, dict]]:
    """Validate an adapter directory, reading its weights file once with the tensor data (all after
    the safetensors header) going straight into `allocate(n)`, a writable n-byte buffer (pinned host
    memory, say). Returns the manifest, whose sha256 is of exactly the bytes read, and the header:
    tensor name → dtype, shape, data_offsets into that buffer."""
    config = _read_config(adapter_dir)
    _check_rank(config, max_rank)
    digest = hashlib.sha256()
    with _weights_file(adapter_dir, max_bytes).open("rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size > max_bytes:  # grown since the size check
            raise _invalid(ErrorCode.ADAPTER_TOO_LARGE, f"{WEIGHTS_FILE} is over the limit of {max_bytes} bytes")

        def read(n: int) -> bytes:
            chunk = f.read(n)
            digest.update(chunk)
            return chunk

        header = _parse_header(read, WEIGHTS_FILE)
        data = allocate(size - f.tell())
        if f.readinto(data) != len(data) or f.read(1):
            raise _invalid(ErrorCode.INVALID_ADAPTER, f"{WEIGHTS_FILE} changed while it was read")
        digest.update(data)
    return _manifest(config, header, model, size=size, sha256=digest.hexdigest()), header


def manifest_of(config: dict, data: bytes, model: ModelInfo, *, sha256: str) -> AdapterManifest:
    """Validate weights file bytes `data` (with `config` from read_adapter_files) against `model`.
    `sha256` is the caller's digest of `data` (a worker hashes on another thread meanwhile)."""
    header = _parse_header(io.BytesIO(data).read, WEIGHTS_FILE)
    return _manifest(config, header, model, size=len(data), sha256=sha256)


def _check_rank(config: dict, max_rank: int) -> None:
    fused = fused_experts(config)
    rank = max([config["r"], *(r for _, r in (fused.ranks if fused else ()))])
    if rank > max_rank:
        raise _invalid(ErrorCode.ADAPTER_RANK_TOO_LARGE, f"rank {rank} exceeds the maximum rank {max_rank}")


def _weights_file(adapter_dir: Path, max_bytes: int) -> Path:
    """The safetensors weights file, refusing pickles and files over `max_bytes` before any read."""
    weights = adapter_dir / WEIGHTS_FILE
    if not weights.is_file():
        pickled = [p.name for p in adapter_dir.glob("*.bin")] + [p.name for p in adapter_dir.glob("*.pt")]
        hint = (
            f" (found {', '.join(pickled)}: pickled weights are never loaded; convert to safetensors)"
            if pickled
            else ""
        )
        raise _invalid(ErrorCode.INVALID_ADAPTER, f"{WEIGHTS_FILE} is missing{hint}")
    size = weights.stat().st_size
    if size > max_bytes:
        raise _invalid(ErrorCode.ADAPTER_TOO_LARGE, f"{WEIGHTS_FILE} is {size} bytes, over the limit of {max_bytes}")
    return weights


def _manifest(config: dict, header: dict[str, dict], model: ModelInfo, *, size: int, sha256: str) -> AdapterManifest:
    """Check every tensor of the weights' header against `model` and the config's rank."""
    rank = config["r"]
    seen: dict[tuple[int, str], set[str]] = {}
    experts_seen: dict[tuple[int, str], set[int]] = {}
    fused = fused_experts(config)
    for name, entry in header.items():
        fused_key = parse_fused_key(name, model) if fused else None
        if fused and fused_key is not None:
            if fused_key.layer not in model.moe_layers:
                raise _invalid(ErrorCode.ADAPTER_SHAPE_MISMATCH, f"{name}: layer {fused_key.layer} has no experts")
            if entry.get("dtype") not in _ACCEPTED_DTYPES:
                raise _invalid(ErrorCode.INVALID_ADAPTER, f"{name}: dtype {entry.get('dtype')!r} is not F16/BF16/F32")
            parameter = fused_parameter_of(list(entry.get("shape", [])), fused_key, fused, model)
            # an A and a B pair up when they sit in the same wrapper and fit the same parameter
            seen.setdefault((fused_key.layer, f"experts.{fused_key.wrapper}{parameter}"), set()).add(fused_key.which)
            experts_seen.setdefault((fused_key.layer, parameter), set()).add(-1)
            continue
        expert = parse_expert_key(name, model)
        if expert is not None:
            if entry.get("dtype") not in _ACCEPTED_DTYPES:
                raise _invalid(ErrorCode.INVALID_ADAPTER, f"{name}: dtype {entry.get('dtype')!r} is not F16/BF16/F32")
            check_expert_tensor(name, expert, list(entry.get("shape", [])), model, rank)
            seen.setdefault((expert.layer, f"experts.{expert.expert}.{expert.projection}"), set()).add(expert.which)
            experts_seen.setdefault((expert.layer, expert.projection), set()).add(expert.expert)
            continue
        match = _LORA_KEY.match(name)
        if match is None:
            raise _invalid(
                ErrorCode.ADAPTER_UNSUPPORTED, f"tensor {name!r} is not a LoRA A/B matrix of a decoder projection"
            )
        layer, projection, which = int(match[1]), match[2], match[3]
        if layer >= model.num_layers:
            raise _invalid(ErrorCode.ADAPTER_SHAPE_MISMATCH, f"{name}: the base model has {model.num_layers} layers")
        if layer in model.moe_layers and projection in ("gate_proj", "up_proj", "down_proj"):
            raise _invalid(ErrorCode.ADAPTER_SHAPE_MISMATCH, f"{name}: layer {layer}'s MLP is a mixture of experts")
        if entry.get("dtype") not in _ACCEPTED_DTYPES:
            raise _invalid(ErrorCode.INVALID_ADAPTER, f"{name}: dtype {entry.get('dtype')!r} is not F16, BF16 or F32")
        in_features, out_features = model.projection_shape(projection)
        expected = [rank, in_features] if which == "A" else [out_features, rank]
        if list(entry.get("shape", [])) != expected:
            raise _invalid(
                ErrorCode.ADAPTER_SHAPE_MISMATCH,
                f"{name}: shape {entry.get('shape')} does not match the base model's {expected}",
            )
        seen.setdefault((layer, projection), set()).add(which)
    if not seen:
        raise _invalid(ErrorCode.INVALID_ADAPTER, f"{WEIGHTS_FILE} holds no LoRA matrices")
    unpaired = sorted(f"layers.{layer}.{proj}" for (layer, proj), parts in seen.items() if parts != {"A", "B"})
    if unpaired:
        raise _invalid(ErrorCode.INVALID_ADAPTER, f"LoRA A without B (or B without A) at {', '.join(unpaired[:3])}")
    targets = {projection for _, projection in seen}
    if fused:
        expert_targets = tuple(f"experts.{p}" for p in FUSED_PARAMETERS if any(p == q for _, q in experts_seen))
    else:
        expert_targets = check_experts_complete(experts_seen, model)
    return AdapterManifest(
        rank=rank,
        lora_alpha=float(config.get("lora_alpha", rank)),
        use_rslora=bool(config.get("use_rslora", False)),
        target_modules=tuple(p for p in PROJECTIONS if p in targets) + expert_targets,
        size_bytes=size,
        sha256=sha256,
        fused_experts=fused,
    )
