"""Which of a worker's base models are resident (an engine on the device), warm (a checkpoint in
the host cache) or cold (only on disk), and the three moves between those tiers.

- `prepare(name, replacing)` (loader thread): model allocated on the device, its weights copied on a
  side stream from the host cache (warm), or from disk: streamed through reused page-locked buffers
  (worker/switching/loader.stream_to_model), or read into host buffers first where the host cache
  will keep them; then the runner: a KV cache carved from a resident slot's KV storage and the
  decode graphs captured, paced beside a serving model so that it keeps >= 80 % of its throughput
  (worker/engine/capture_pacer.py). It runs while the resident models keep serving; the device memory it
  takes is the prefetch reserve that resident models leave free when the worker serves more models
  than it keeps resident.
- `activate(prepared)` (engine thread): the engine around the prepared runner (milliseconds).
- `evict(name)` (engine thread): drop the engine; its checkpoint stays warm if the cache holds it,
  and its KV storage stays allocated for the next model of that slot.

KV storage belongs to resident slots, not to models: one flat buffer per slot, sized once, that each
model occupying the slot views with its own layout. A model prepared to replace `replacing` gets that
model's storage, so its decode graphs are captured against their final addresses before the
hand-over, while `replacing` still serves from the same memory (capture writes nothing), and the
hand-over itself only swaps engines.

Every budget (weights, LoRA slots, staging, activations, the slots' KV storage) comes from one
memory plan (worker/memory_plan.py), made once at start: a configuration that cannot fit fails then.
This is the one way an engine is built, for the worker and for tests alike.

`engines` is the dict the engine thread steps; only the engine thread changes it once serving.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import structlog
import torch
from tokenizers import Tokenizer

from shared.config import ModelSpec, WorkerConfig
from worker.engine.capture_pacer import BUSY_FRACTION, CapturePacer
from worker.engine.engine import LLMEngine
from worker.engine.model_runner import ModelRunner
from worker.engine.step_channel import StepChannel
from worker.memory_plan import DeviceMemory, plan_memory
from worker.metrics import WorkerMetrics
from worker.switching.checkpoint_cache import CheckpointCache, HostWeights
from worker.switching.loader import (
    checkpoint_bytes,
    copy_to_model,
    new_model,
    read_to_host,
    served_info,
    stream_to_model,
)
from worker.switching.shard_reader import StagingRing

log = structlog.get_logger(__name__)

# Until this worker has measured its own (each load updates them): a PCIe 4 x16 pinned copy, a
# local NVMe read, and a host memcpy for CPU workers.
_DEFAULT_H2D_BYTES_PER_S = {"cuda": 20e9, "cpu": 5e9}
_DEFAULT_DISK_BYTES_PER_S = 1e9
_BUILD_S = {"cuda": 0.5, "cpu": 0.05}  # KV cache and decode-graph capture, before the hand-over
_SMOOTHING = 0.5  # weight of the newest measurement in the bandwidth estimates


@dataclass(slots=True)
class PreparedModel:
    spec: ModelSpec
    runner: ModelRunner  # weights on the device, KV cache carved from kv_storage, decode graphs captured
    tokenizer: Tokenizer
    kv_storage: torch.Tensor  # flat uint8: the resident slot's storage this model will occupy
    read_s: float  # disk → host, or disk → device when streamed; 0 for a warm model
    copy_s: float  # host → device; 0 when streamed (the copies overlap the reads)
    build_s: float  # KV cache and decode graphs
    nbytes: int


class ModelResidency:
    def __init__(self, config: WorkerConfig, metrics: WorkerMetrics, channel: StepChannel | None = None) -> None:
        """Plan the device's memory for `config.models` (raises MemoryPlanError if they cannot fit);
        nothing is loaded until `prepare`. `metrics`: where the engines record their series.
        `channel`: this process is a rank of a tensor-parallel group of config.engine.tensor_parallel
        ranks (worker/tensor_parallel.py), and its models are its shares, run in step with the others."""
        if (channel.tp.size if channel is not None else 1) != config.engine.tensor_parallel:
            raise ValueError(f"a residency of tensor_parallel={config.engine.tensor_parallel} needs a group that size")
        self.config = config
        self.channel = channel
        self._metrics = metrics
        self.specs = {spec.name: spec for spec in config.models}
        self.infos = {name: served_info(spec, config.engine) for name, spec in self.specs.items()}
        self.device = torch.device(config.engine.device)
        memory = DeviceMemory.measure(self.device) if self.device.type == "cuda" else None
        self.plan = plan_memory(
            self.infos, config.engine, memory=memory, max_resident_models=config.max_resident_models
        )
        log.info("memory_plan", **self.plan.summary())
        self.cache = CheckpointCache(config.cpu_model_cache_bytes)
        self.engines: dict[str, LLMEngine] = {}
        self.resident_since: dict[str, float] = {}  # monotonic time each resident model came in
        self.nbytes = {name: checkpoint_bytes(spec.path) for name, spec in self.specs.items()}
        self.slots = self.plan.resident_slots
        self.h2d_bytes_per_s = _DEFAULT_H2D_BYTES_PER_S[self.device.type]
        self.disk_bytes_per_s = _DEFAULT_DISK_BYTES_PER_S
        self._lock = threading.Lock()  # the cache and estimates: loader thread vs the event loop
        self._resident_names: tuple[str, ...] = ()  # a snapshot readable from any thread
        self._kv_storage: dict[str, torch.Tensor] = {}  # resident model → its slot's KV storage
        self._free_kv_storage: list[torch.Tensor] = []  # storage of slots whose model was evicted
        self._staging = StagingRing(pin=self.device.type == "cuda")  # cold streamed loads' reused buffers
        self._staging_lock = threading.Lock()  # one streamed load at a time owns them

    # -- tiers ----------------------------------------------------------------------------------

    @property
    def resident(self) -> tuple[str, ...]:
        return self._resident_names

    def tiers(self) -> dict[str, list[str]]:
        """resident / warm / cold model names, for the heartbeat."""
        resident = self._resident_names
        with self._lock:
            warm = [name for name in self.cache.names() if name not in resident]
        cold = [name for name in self.specs if name not in resident and name not in warm]
        return {"resident": list(resident), "warm": warm, "cold": cold}

    def switch_cost_s(self, name: str) -> float:
        """How long a switch to `name` takes until it serves: its bytes over its tier's bandwidth, plus
        building its KV cache and decode graphs (the hand-over itself is milliseconds)."""
        with self._lock:
            warm = name in self.cache
            copy_s = self.nbytes[name] / self.h2d_bytes_per_s
            read_s = 0.0 if warm else self.nbytes[name] / self.disk_bytes_per_s
        build_s = _BUILD_S[self.device.type] / (BUSY_FRACTION if self._resident_names else 1.0)  # paced beside
        return read_s + copy_s + build_s

    # -- moves ----------------------------------------------------------------------------------

    def prepare(self, name: str, replacing: str | None = None) -> PreparedModel:
        """Bring `name` onto the device beside the resident models, ready to serve from the KV storage
        of `replacing` (a resident model a switch will evict), else of a free slot. Call off the
        engine thread: the resident models keep serving meanwhile."""
        spec = self.specs[name]
        stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        pin = self.device.type == "cuda"
        with self._lock:
            host = self.cache.get(name)
            keep = host is None and self.nbytes[name] <= self.cache.capacity_bytes
        read_s = 0.0
        if keep:  # the cache will hold it: read it into host buffers once, for this load and the next
            started = time.perf_counter()
            host = read_to_host(name, spec.path, pin=pin)
            read_s = time.perf_counter() - started
            self._cache(host, read_s)
        model = new_model(self.infos[name], self.config.engine, self.channel.tp if self.channel is not None else None)
        copy_started = time.perf_counter()
        if host is None:  # disk to device, the reads overlapping the copies
            with self._staging_lock:
                stream_to_model(model, name, spec.path, self._staging, stream)
            read_s = time.perf_counter() - copy_started
            nbytes = self.nbytes[name]
            with self._lock:
                self.disk_bytes_per_s = _smooth(self.disk_bytes_per_s, nbytes / max(read_s, 1e-6))
            copy_s = 0.0  # overlapped with the read
        else:
            copy_to_model(model, host, stream)
            copy_s = time.perf_counter() - copy_started
            nbytes = host.nbytes
            with self._lock:
                self.h2d_bytes_per_s = _smooth(self.h2d_bytes_per_s, nbytes / max(copy_s, 1e-6))
        build_started = time.perf_counter()
        storage = self._kv_storage[replacing] if replacing is not None else self._storage_for_free_slot()
        # beside a serving model the captures yield to it (capture_pacer.py); alone they go flat out
        pacer = CapturePacer(self._serving) if self._resident_names else None
        runner = ModelRunner(
            model, self.config.engine, storage, self.plan.kv_blocks(name), pacer=pacer, channel=self.channel
        )
        tokenizer = Tokenizer.from_file(str(spec.path / "tokenizer.json"))
        build_s = time.perf_counter() - build_started
        log.info(
            "model_prepared",
            model=name,
            tier="cold" if read_s else "warm",
            gb=round(nbytes / 1e9, 3),
            read_s=round(read_s, 3),
            copy_s=round(copy_s, 3),
            build_s=round(build_s, 3),
        )
        return PreparedModel(spec, runner, tokenizer, storage, read_s, copy_s, build_s, nbytes)

    def _serving(self) -> bool:
        """Whether a resident model has requests now: read from the loader thread (a snapshot of the
        names, then each engine's count of unfinished requests, a length read under the GIL)."""
        engines = [self.engines.get(name) for name in self._resident_names]
        return any(engine is not None and engine.num_unfinished for engine in engines)

    def _cache(self, host: HostWeights, read_s: float) -> None:
        with self._lock:
            self.disk_bytes_per_s = _smooth(self.disk_bytes_per_s, host.nbytes / max(read_s, 1e-6))
            evicted = self.cache.put(host)
            kept = host.model in self.cache
        if evicted or not kept:
            log.info("host_model_cache", cached=host.model if kept else None, evicted=evicted)

    def activate(self, prepared: PreparedModel) -> LLMEngine:
        """Make a prepared model resident in the slot whose KV storage it took. Call on the engine
        thread, after evicting the model it replaces."""
        name = prepared.spec.name
        engine = LLMEngine(
            prepared.runner,
            prepared.tokenizer,
            self.config.engine,
            self.config.adapter_root,
            self._metrics.engine(name),
        )
        self._free_kv_storage = [s for s in self._free_kv_storage if s is not prepared.kv_storage]
        self._kv_storage[name] = prepared.kv_storage
        self.engines[name] = engine
        self.resident_since[name] = time.monotonic()
        self._resident_names = tuple(self.engines)
        return engine

    def _storage_for_free_slot(self) -> torch.Tensor:
        """A slot's KV storage no resident model holds: an evicted model's, else a new one of the
        plan's size."""
        if self._free_kv_storage:
            return self._free_kv_storage[-1]
        return torch.zeros(self.plan.kv_storage_bytes, dtype=torch.uint8, device=self.device)

    def evict(self, name: str) -> None:
        """Drop `name`'s engine; its slot's KV storage waits for the next model. Call on the engine
        thread, once it has no unfinished requests."""
        if self.engines[name].num_unfinished:
            raise RuntimeError(f"evicting {name!r} with {self.engines[name].num_unfinished} unfinished requests")
        engine = self.engines.pop(name)
        if engine.adapter_pool is not None:  # its host arena's page-locked memory goes back now, not at collection
            engine.adapter_pool.close()
        self._free_kv_storage.append(self._kv_storage.pop(name))
        self.resident_since.pop(name, None)
        self._resident_names = tuple(self.engines)

    def fits_beside_resident(self, name: str) -> bool:
        """Whether `name` (its weights, LoRA slots, staging and activations: the plan's footprint) fits
        in device memory now, beside the resident models (an overlapped prefetch, for which the plan
        keeps the reserve); if not, the switch evicts first and loads after."""
        if self.device.type != "cuda":
            return True
        return DeviceMemory.measure(self.device).usable(self.config.engine) >= self.plan.footprints[name].fixed

    def warm_up(self, name: str) -> None:
        """Read a cold model into the host cache ahead of need, if it fits (loader thread)."""
        with self._lock:
            if name in self.cache or self.nbytes[name] > self.cache.capacity_bytes - self.cache.used_bytes:
                return
        started = time.perf_counter()
        host = read_to_host(name, self.specs[name].path, pin=self.device.type == "cuda")
        self._cache(host, time.perf_counter() - started)


def _smooth(previous: float, measured: float) -> float:
    return (1 - _SMOOTHING) * previous + _SMOOTHING * measured
