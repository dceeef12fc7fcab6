"""Which of a worker's base models are resident (an engine on the device), warm (a checkpoint in
the host cache) or cold (only on disk), and the three moves between those tiers.

- `prepare(name)` (loader thread): checkpoint to host (a warm hit, or a cold read into pinned
  buffers, then cached), model allocated on the device, weights copied on a side stream. It runs
  while the resident models keep serving; the device memory it takes is the prefetch reserve that
  resident models leave free when the worker serves more models than it keeps resident.
- `activate(prepared)` (engine thread): KV cache, decode graphs and engine around the prepared model.
- `evict(name)` (engine thread): drop the engine; its checkpoint stays warm if the cache holds it.

`engines` is the dict the engine thread steps; only the engine thread changes it once serving.
"""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import structlog
import torch
from tokenizers import Tokenizer

from shared.config import ModelSpec, WorkerConfig
from shared.model_info import ModelInfo
from worker.engine.engine import LLMEngine
from worker.engine.model import CausalLM
from worker.engine.model_runner import ModelRunner, device_bytes_left, engine_dtype
from worker.models.host_cache import HostModelCache, HostWeights
from worker.models.loader import checkpoint_bytes, copy_to_model, read_to_host

log = structlog.get_logger(__name__)

# Until this worker has measured its own (each load updates them): a PCIe 4 x16 pinned copy, a
# local NVMe read, and a host memcpy for CPU workers.
_DEFAULT_H2D_BYTES_PER_S = {"cuda": 20e9, "cpu": 5e9}
_DEFAULT_DISK_BYTES_PER_S = 1e9
_HANDOVER_S = {"cuda": 0.5, "cpu": 0.05}  # KV allocation and graph capture at hand-over
_SMOOTHING = 0.5  # weight of the newest measurement in the bandwidth estimates
# With no --max-resident-models on CUDA, resident weights (plus the prefetch reserve) take at most
# this share of the memory left, keeping the rest for KV caches and activations.
_WEIGHTS_SHARE = 0.75


@dataclass(slots=True)
class PreparedModel:
    spec: ModelSpec
    model: CausalLM
    read_s: float  # disk → host; 0 for a warm model
    copy_s: float  # host → device
    nbytes: int


NewEngine = Callable[[str, ModelRunner, Tokenizer], LLMEngine]  # (model name, runner, tokenizer) → engine


class ModelResidency:
    def __init__(self, config: WorkerConfig, new_engine: NewEngine) -> None:
        self.config = config
        self._new_engine = new_engine
        self.specs = {spec.name: spec for spec in config.models}
        self.device = torch.device(config.engine.device)
        self.cache = HostModelCache(config.cpu_model_cache_bytes)
        self.engines: dict[str, LLMEngine] = {}
        self.resident_since: dict[str, float] = {}  # monotonic time each resident model came in
        self.nbytes = {name: checkpoint_bytes(spec.path) for name, spec in self.specs.items()}
        self.slots = min(len(self.specs), config.max_resident_models or self._fitting_count())
        self.h2d_bytes_per_s = _DEFAULT_H2D_BYTES_PER_S[self.device.type]
        self.disk_bytes_per_s = _DEFAULT_DISK_BYTES_PER_S
        self._lock = threading.Lock()  # the cache and estimates: loader thread vs the event loop
        self._resident_names: tuple[str, ...] = ()  # a snapshot readable from any thread

    def _fitting_count(self) -> int:
        """Models (in the order given) whose weights, with the prefetch reserve for the largest
        of the others, fit in _WEIGHTS_SHARE of the device memory left; all of them on CPU."""
        if self.device.type != "cuda":
            return len(self.specs)
        budget = _WEIGHTS_SHARE * device_bytes_left(self.config.engine, self.device)
        sizes = list(self.nbytes.values())
        for count in range(len(sizes), 0, -1):
            reserve = max(sizes[count:], default=0)
            if sum(sizes[:count]) + reserve <= budget:
                return count
        return 1

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
        """The pause a switch to `name` costs: its bytes over its tier's bandwidth, plus the hand-over."""
        with self._lock:
            warm = name in self.cache
            copy_s = self.nbytes[name] / self.h2d_bytes_per_s
            read_s = 0.0 if warm else self.nbytes[name] / self.disk_bytes_per_s
        return read_s + copy_s + _HANDOVER_S[self.device.type]

    # -- moves ----------------------------------------------------------------------------------

    def prepare(self, name: str) -> PreparedModel:
        """Bring `name`'s weights onto the device beside the resident models (call off the engine thread)."""
        spec = self.specs[name]
        started = time.perf_counter()
        with self._lock:
            host = self.cache.get(name)
        read_s = 0.0
        if host is None:
            host = read_to_host(name, spec.path, pin=torch.cuda.is_available())
            read_s = time.perf_counter() - started
            self._cache(host, read_s)
        info = ModelInfo.from_pretrained(name, spec.path)
        engine = self.config.engine
        model = CausalLM(
            info,
            max_loras=engine.max_loras,
            max_lora_rank=engine.max_lora_rank,
            dtype=engine_dtype(engine.dtype, info, self.device),
            device=self.device,
        )
        copy_started = time.perf_counter()
        copy_to_model(model, host, torch.cuda.Stream(self.device) if self.device.type == "cuda" else None)
        copy_s = time.perf_counter() - copy_started
        with self._lock:
            self.h2d_bytes_per_s = _smooth(self.h2d_bytes_per_s, host.nbytes / max(copy_s, 1e-6))
        log.info(
            "model_prepared",
            model=name,
            tier="cold" if read_s else "warm",
            gb=round(host.nbytes / 1e9, 3),
            read_s=round(read_s, 3),
            copy_s=round(copy_s, 3),
        )
        return PreparedModel(spec, model, read_s, copy_s, host.nbytes)

    def _cache(self, host: HostWeights, read_s: float) -> None:
        with self._lock:
            self.disk_bytes_per_s = _smooth(self.disk_bytes_per_s, host.nbytes / max(read_s, 1e-6))
            evicted = self.cache.put(host)
            kept = host.model in self.cache
        if evicted or not kept:
            log.info("host_model_cache", cached=host.model if kept else None, evicted=evicted)

    def activate(self, prepared: PreparedModel) -> LLMEngine:
        """Make a prepared model resident: KV cache sized from what is left (less the prefetch reserve
        when some model is not resident), then the engine. Call on the engine thread."""
        name = prepared.spec.name
        runner = ModelRunner.from_model(prepared.model, self.config.engine, kv_memory_share=self._kv_share(name))
        tokenizer = Tokenizer.from_file(str(prepared.spec.path / "tokenizer.json"))
        engine = self._new_engine(name, runner, tokenizer)
        self.engines[name] = engine
        self.resident_since[name] = time.monotonic()
        self._resident_names = tuple(self.engines)
        return engine

    def _kv_share(self, incoming: str) -> float:
        """The incoming model's part of the memory left: an equal split among the resident slots still
        to fill, after keeping room to prefetch the largest model that will not be resident."""
        open_slots = self.slots - len(self.engines)
        if self.device.type != "cuda":
            return 1.0 / open_slots
        outside = [n for n in self.specs if n not in self.engines and n != incoming]
        reserve = max((self.nbytes[n] for n in outside), default=0)
        left = device_bytes_left(self.config.engine, self.device)
        return max(0.0, (left - reserve) / max(left, 1)) / open_slots

    def evict(self, name: str) -> None:
        """Drop `name`'s engine and give its device memory back. Call on the engine thread, once it
        has no unfinished requests."""
        if self.engines[name].num_unfinished:
            raise RuntimeError(f"evicting {name!r} with {self.engines[name].num_unfinished} unfinished requests")
        del self.engines[name]
        self.resident_since.pop(name, None)
        self._resident_names = tuple(self.engines)
        gc.collect()  # the engine holds reference cycles (runner ↔ graphs); free the device memory now
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def fits_beside_resident(self, name: str) -> bool:
        """Whether `name`'s weights fit in device memory now, beside the resident models (an overlapped
        prefetch); if not, the switch evicts first and loads after."""
        if self.device.type != "cuda":
            return True
        return device_bytes_left(self.config.engine, self.device) >= self.nbytes[name]

    def warm_up(self, name: str) -> None:
        """Read a cold model into the host cache ahead of need, if it fits (loader thread)."""
        with self._lock:
            if name in self.cache or self.nbytes[name] > self.cache.capacity_bytes - self.cache.used_bytes:
                return
        started = time.perf_counter()
        host = read_to_host(name, self.specs[name].path, pin=torch.cuda.is_available())
        self._cache(host, time.perf_counter() - started)


def _smooth(previous: float, measured: float) -> float:
    return (1 - _SMOOTHING) * previous + _SMOOTHING * measured
