"""The worker's metrics as the engine thread records them from a real engine (tiny checkpoint, CPU),
and the GPU series' device lookup. The HTTP endpoint of a real worker process is tested in
tests/e2e/test_worker_metrics.py."""

from __future__ import annotations

import queue

import pytest
import torch

from tests.engine.engines import load_engine
from tests.engine.test_engine_generation import NEW_TOKENS, greedy_request
from tests.engine.tiny_hf import TinyCheckpoint
from worker.engine.engine_request import EngineResult
from worker.engine_thread import EngineThread, StepOutput
from worker.gpu_metrics import SLOWDOWN_REASONS, GpuCollector, cuda_index, nvml_id, slowdowns
from worker.metrics import AdapterTier, EngineLoad, WorkerMetrics


def run_on_thread(metrics: WorkerMetrics, checkpoint: TinyCheckpoint, adapters: list[str | None]) -> list[EngineResult]:
    adapter_root = next(iter(checkpoint.adapters.values())).parent
    settings = {"device": "cpu", "max_lora_rank": 8, "num_kv_blocks": 64, "block_size": 4, "max_loras": 2}
    engine = load_engine(checkpoint.model_dir, adapter_root, name="tiny", metrics=metrics, **settings)
    results: queue.Queue[EngineResult] = queue.Queue()
    crashes: list[BaseException] = []

    def on_output(output: StepOutput) -> None:
        for result in output.results:
            results.put(result)

    thread = EngineThread({"tiny": engine}, on_output=on_output, on_crash=crashes.append)
    thread.start()
    for index, adapter in enumerate(adapters):
        thread.submit("tiny", greedy_request(checkpoint, f"job{index}", adapter))
    finished = [results.get(timeout=120) for _ in adapters]
    thread.stop()
    assert not crashes
    return finished


def value(metrics: WorkerMetrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


def test_steps_record_batches_tokens_and_an_empty_cache_after(llama: TinyCheckpoint):
    metrics = WorkerMetrics(device="cpu")
    adapters = [None, "all_r8", "mlp_k_r4", None]
    finished = run_on_thread(metrics, llama, adapters)

    generated = sum(result.completion_tokens for result in finished)
    assert generated == NEW_TOKENS * len(adapters)
    assert value(metrics, "lorafleet_worker_generated_tokens_total", model="tiny") == generated
    steps = value(metrics, "lorafleet_worker_batch_size_count", model="tiny")
    assert steps is not None and NEW_TOKENS <= steps < generated  # requests shared steps
    assert value(metrics, "lorafleet_worker_batch_size_sum", model="tiny") >= generated
    assert value(metrics, "lorafleet_worker_step_seconds_count", model="tiny") == steps
    assert value(metrics, "lorafleet_worker_step_seconds_sum", model="tiny") > 0
    assert value(metrics, "lorafleet_worker_device_idle_seconds_count", model="tiny") == 0  # measured on CUDA only
    prompt_tokens = sum(len(greedy_request(llama, "", a).prompt_token_ids) for a in adapters)
    # every prompt token is processed once; every output token but the last is fed back once
    fed_back = generated - len(adapters)
    assert value(metrics, "lorafleet_worker_batch_tokens_sum", model="tiny") == prompt_tokens + fed_back
    # two adapters, one sequence each: at most 2 a step, and both in each of their sequences' decode steps
    assert value(metrics, "lorafleet_worker_batch_adapters_bucket", model="tiny", le="2.0") == steps
    assert value(metrics, "lorafleet_worker_batch_adapters_sum", model="tiny") >= 2 * (NEW_TOKENS - 1)
    assert value(metrics, "lorafleet_worker_running_seqs", model="tiny") == 0
    assert value(metrics, "lorafleet_worker_waiting_seqs", model="tiny") == 0
    assert value(metrics, "lorafleet_worker_kv_blocks_used", model="tiny") == 0
    assert value(metrics, "lorafleet_worker_kv_blocks_total", model="tiny") == 64
    assert value(metrics, "lorafleet_worker_adapters_resident", model="tiny", tier="gpu") == 2


def test_the_queues_are_recorded_per_priority_class():
    metrics = WorkerMetrics(device="cpu")
    load = EngineLoad(running=5, waiting=3, kv_blocks_used=0, kv_blocks_total=8, preemptions=0,
                      running_batch=2, waiting_batch=1)  # fmt: skip

    metrics.engine("m").record_load(load)

    seqs = {(p, s): value(metrics, "lorafleet_worker_class_seqs", model="m", priority=p, state=s)
            for p in ("interactive", "batch") for s in ("running", "waiting")}  # fmt: skip
    assert seqs == {("interactive", "running"): 3, ("interactive", "waiting"): 2,
                    ("batch", "running"): 2, ("batch", "waiting"): 1}  # fmt: skip


def test_adapter_series_exist_for_every_tier_before_anything_is_recorded():
    metrics = WorkerMetrics(device="cpu")
    recorder = metrics.engine("m").adapters
    for tier in AdapterTier:
        assert value(metrics, "lorafleet_worker_adapter_hits_total", model="m", tier=tier) == 0
        assert value(metrics, "lorafleet_worker_adapter_misses_total", model="m", tier=tier) == 0
    recorder.hit(AdapterTier.CPU)
    recorder.miss(AdapterTier.GPU)
    recorder.evicted(AdapterTier.GPU)
    recorder.loaded(AdapterTier.DISK, 0.02)
    recorder.set_resident(AdapterTier.CPU, 5)
    assert value(metrics, "lorafleet_worker_adapter_hits_total", model="m", tier="cpu") == 1
    assert value(metrics, "lorafleet_worker_adapter_misses_total", model="m", tier="gpu") == 1
    assert value(metrics, "lorafleet_worker_adapter_evictions_total", model="m", tier="gpu") == 1
    assert value(metrics, "lorafleet_worker_adapter_load_seconds_sum", model="m", tier="disk") == pytest.approx(0.02)
    assert value(metrics, "lorafleet_worker_adapters_resident", model="m", tier="cpu") == 5


def test_cuda_ordinals_map_to_nvml_through_cuda_visible_devices():
    assert cuda_index("cpu") is None
    assert cuda_index("cuda") == 0 and cuda_index("cuda:3") == 3
    assert nvml_id(1, None) == 1
    assert nvml_id(0, "2,3") == 2 and nvml_id(1, "2, 3") == 3
    assert nvml_id(0, "GPU-8e1c1d9a-0000") == "GPU-8e1c1d9a-0000"
    with pytest.raises(LookupError):
        nvml_id(1, "0")
    with pytest.raises(LookupError):
        nvml_id(0, "")


def test_clock_event_bits_decode_to_the_reasons_that_slow_the_device():
    assert slowdowns(0) == dict.fromkeys(SLOWDOWN_REASONS, False)
    # idle (0x1) and the application-clocks setting (0x2) hold nothing down; the power cap (0x4) and
    # hardware thermal slowdown (0x40) with the hardware-slowdown bit (0x8) do
    assert not any(slowdowns(0x1 | 0x2).values())
    assert {reason for reason, on in slowdowns(0x1 | 0x4 | 0x8 | 0x40).items() if on} == {
        "sw_power_cap", "hw_slowdown", "hw_thermal"
    }  # fmt: skip


def test_a_cpu_worker_exports_no_gpu_series():
    assert GpuCollector.for_device("cpu") is None
    exported = {metric.name for metric in WorkerMetrics(device="cpu").registry.collect()}
    assert not any(name.startswith("lorafleet_worker_gpu_") for name in exported)


@pytest.mark.gpu
def test_a_cuda_worker_exports_its_gpus_memory_and_utilisation():
    torch.ones(1, device="cuda")  # a context, so some memory is in use
    metrics = WorkerMetrics(device="cuda")
    total = metrics.registry.get_sample_value("lorafleet_worker_gpu_memory_total_bytes", {"gpu": _gpu_label(metrics)})
    used = metrics.registry.get_sample_value("lorafleet_worker_gpu_memory_used_bytes", {"gpu": _gpu_label(metrics)})
    busy = metrics.registry.get_sample_value("lorafleet_worker_gpu_utilization_ratio", {"gpu": _gpu_label(metrics)})
    assert abs(total - torch.cuda.get_device_properties(0).total_memory) < 0.05 * total  # NVML and CUDA agree
    assert 0 < used <= total
    assert 0.0 <= busy <= 1.0


@pytest.mark.gpu
def test_a_cuda_worker_exports_its_gpus_clocks_power_temperature_and_slowdowns():
    metrics = WorkerMetrics(device="cuda")
    gpu = {"gpu": _gpu_label(metrics)}

    def read(name: str, **labels: str) -> float:
        return metrics.registry.get_sample_value(f"lorafleet_worker_gpu_{name}", gpu | labels)

    assert 100e6 < read("sm_clock_hertz") < 5e9 and 100e6 < read("memory_clock_hertz") < 20e9
    assert 1.0 < read("power_watts") < 2000.0
    assert 0.0 < read("temperature_celsius") < 120.0
    assert all(read("clocks_slowed", reason=reason) in (0.0, 1.0) for reason in SLOWDOWN_REASONS)


def _gpu_label(metrics: WorkerMetrics) -> str:
    (family,) = [m for m in metrics.registry.collect() if m.name == "lorafleet_worker_gpu_memory_total_bytes"]
    return family.samples[0].labels["gpu"]
