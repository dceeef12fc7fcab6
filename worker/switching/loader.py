"""Checkpoints onto the device, from disk or from host memory, and into host memory.

Cold, streamed (`stream_to_model`): the shards are read (worker/switching/shard_reader.py: large
parallel reads, O_DIRECT where allowed) into a StagingRing of reused page-locked buffers, and each
segment's copies to the device are queued on a side stream while the next segments are read: the
load takes about the disk's time, and the host holds a few segments, not the checkpoint.

Cold, kept (`read_to_host`): the same reads into fresh buffers that become the warm tier's host copy
(each page-locked, exact size, on a helper thread while the next one is read).

Warm (`copy_to_model`): the copies go tensor by tensor (in pieces, weights.COPY_CHUNK_BYTES) on a
side CUDA stream, so the model being served keeps its own stream, and the caller waits only for that
side stream. Both device fills are paced (weights.paced_copies) beside a serving model.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from shared.bnb_tensors import check_bnb_tensors
from shared.config import EngineConfig, ModelSpec
from shared.errors import ErrorCode, LorafleetError
from shared.int4_quantization import CODEBOOK_FORMATS, INT4_METHODS
from shared.int4_tensors import check_int4_tensors
from shared.model_info import ModelInfo
from worker.model.model import CausalLM, model_dtype
from worker.model.parallel.group import TensorParallel
from worker.model.weights import checkpoint_files, paced_copies
from worker.switching.checkpoint_cache import HostWeights
from worker.switching.shard_reader import KeptBuffers, StagingRing, read_tensors


def checkpoint_bytes(model_dir: Path) -> int:
    """Bytes of the checkpoint's safetensors files: what a cold load reads and a warm one copies."""
    return sum(path.stat().st_size for path in checkpoint_files(model_dir))


def read_to_host(model: str, model_dir: Path, *, pin: bool) -> HostWeights:
    """Read every safetensors file of the checkpoint into host buffers (page-locked if `pin`); the
    tensors are views of them under their checkpoint names. Nothing is unpickled: safetensors only."""
    buffers = KeptBuffers(pin=pin)
    tensors = dict(read_tensors(model, checkpoint_files(model_dir), buffers))
    nbytes = sum(tensor.numel() * tensor.element_size() for tensor in tensors.values())
    return HostWeights(model=model, tensors=tensors, nbytes=nbytes, pinned=pin, keepalive=buffers.page_locks())


# FP8 tensor cores, and Triton's fp8 conversions: Ada (8.9), Hopper (9.0) and later
_FP8_CAPABILITY = (8, 9)


def served_info(spec: ModelSpec, config: EngineConfig) -> ModelInfo:
    """`spec`'s model as this worker serves it (config.quantization, config.kv_cache_dtype), refused
    at start, naming the checkpoint, when the device cannot (fp8 needs FP8 tensor cores) or a 4-bit
    checkpoint's tensors are not what its format says."""
    info = ModelInfo.from_pretrained(spec.name, spec.path).served(
        quantization=config.quantization,
        kv_cache_dtype=config.kv_cache_dtype,
        source=spec.path,
        int4_decode_copy=config.int4_decode_copy and torch.device(config.device).type == "cuda",
    )
    if info.checkpoint_quantization in INT4_METHODS:
        check_int4_tensors(spec.path, info)  # before any weight is read
    if info.checkpoint_quantization in CODEBOOK_FORMATS:
        check_bnb_tensors(spec.path, info)
    device = torch.device(config.device)
    if device.type == "cuda" and "fp8" in (info.quantization, info.kv_cache_dtype):
        capability = torch.cuda.get_device_capability(device)
        if capability < _FP8_CAPABILITY:
            raise LorafleetError(
                ErrorCode.INVALID_REQUEST,
                f"{spec.path}: fp8 weights or KV cache need FP8 tensor cores (compute capability 8.9 or later); "
                f"{torch.cuda.get_device_name(device)} is {capability[0]}.{capability[1]}",
            )
    return info


def new_model(info: ModelInfo, config: EngineConfig, tp: TensorParallel | None = None) -> CausalLM:
    """`info`'s model on config.device with LoRA slots for config.max_loras adapters of
    config.max_lora_rank, its weights uninitialised until `copy_to_model` fills them; `tp`: this
    process's rank of a tensor-parallel group (it builds and loads its share of the model)."""
    return CausalLM(
        info,
        max_loras=config.max_loras,
        max_lora_rank=config.max_lora_rank,
        dtype=model_dtype(config.dtype, info, config.device),
        device=config.device,
        tp=tp,
    )


def stream_to_model(
    model: CausalLM, name: str, model_dir: Path, staging: StagingRing, stream: torch.cuda.Stream | None
) -> None:
    """Fill `model`'s parameters straight from the checkpoint's files through `staging` (page-locked
    on CUDA), the copies queued on `stream` as copy_to_model queues them; returns once they are done."""
    with contextlib.ExitStack() as scope:
        if stream is not None:
            scope.enter_context(torch.cuda.stream(stream))
            scope.enter_context(paced_copies())
        # closed inside the stream's scope: a load stopped early releases its buffer after what it queued
        tensors = scope.enter_context(
            contextlib.closing(read_tensors(name, checkpoint_files(model_dir), staging, window=staging.count))
        )
        model.load_tensors(tensors, source=name)
    if stream is not None:
        stream.synchronize()


def copy_to_model(model: CausalLM, host: HostWeights, stream: torch.cuda.Stream | None) -> None:
    """Fill `model`'s parameters from `host`. On CUDA the copies are queued on `stream` (a side
    stream: the serving model's kernels on the default stream go on meanwhile), paced so that the
    serving model's own small copies are never stuck behind the whole model, and this returns once
    they are done, so the weights may then be used from any stream."""
    if stream is None:
        model.load_tensors(host.tensors.items(), source=host.model)
        return
    with torch.cuda.stream(stream), paced_copies():
        model.load_tensors(host.tensors.items(), source=host.model)
    stream.synchronize()
