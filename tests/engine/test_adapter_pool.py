"""The adapter pool inside the engine: prefetch that never blocks a step on disk, the host tier,
versions that never share weights, start-up checks, and slots that never leak an evicted adapter."""

from __future__ import annotations

import dataclasses
import json
import shutil
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from shared.adapter_digest import file_digest
from shared.adapter_format import WEIGHTS_FILE
from shared.errors import ErrorCode, LorafleetError
from shared.schema import AdapterRef, JobStatus
from tests.engine.engines import host_adapter, load_engine
from tests.engine.test_engine_generation import (
    assert_matches_oracle,
    expected_tokens,
    greedy_request,
    make_engine,
    run_to_completion,
)
from tests.engine.tiny_hf import TinyCheckpoint, saved_adapter_ref
from worker.adapter_pool import rank_adapter
from worker.adapter_pool.host_adapter import HostAdapter, fresh_buffers, max_adapter_bytes, read_host_adapter
from worker.adapter_pool.slot_writer import SlotWriter
from worker.engine.block_manager import BlockManager
from worker.engine.model_runner import ModelRunner
from worker.engine.scheduler import ScheduledSequence
from worker.engine.sequence import Sequence
from worker.metrics import WorkerMetrics

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")],
    ),
]
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]


def make_runner(checkpoint: TinyCheckpoint, device: str) -> ModelRunner:
    settings = {"device": device, "dtype": "float32", "max_loras": 2, "max_lora_rank": 16}
    root = next(iter(checkpoint.adapters.values())).parent
    return load_engine(checkpoint.model_dir, root, num_kv_blocks=16, block_size=4, **settings).runner


def slot_logits(runner: ModelRunner, slot: int) -> torch.Tensor:
    """Prefill logits of PROMPT with every token routed to `slot`."""
    seq = Sequence(seq_id="probe", prompt_token_ids=PROMPT, sampling=None, seed=0, adapter_uid="probe")
    BlockManager(runner.num_blocks, 4).allocate(seq, len(PROMPT))
    return runner.execute([ScheduledSequence(seq, len(PROMPT))], lambda uid: slot, 4).cpu()


def slot_contents(runner: ModelRunner, slot: int) -> list[torch.Tensor]:
    """Every LoRA matrix of `slot`, padding past the rank included."""
    return [
        stacked[slot].cpu()
        for layer in runner.model.model.layers
        for linear in layer.lora_linears()
        for stacked in (*linear.lora_a, *linear.lora_b)
    ]


@pytest.mark.parametrize("device", DEVICES)
def test_an_evicted_slot_leaks_nothing_into_a_lower_rank_adapter(llama: TinyCheckpoint, device: str):
    # all_r8: rank 8 on every projection; mlp_k_r4: rank 4 on four of them
    reused, fresh = make_runner(llama, device), make_runner(llama, device)
    writer = SlotWriter(reused.model)
    writer.write((1,), host_adapter(llama.adapters["all_r8"], reused.model)).wait()
    old = slot_logits(reused, 1)

    writer.write((1,), host_adapter(llama.adapters["mlp_k_r4"], reused.model)).wait()
    SlotWriter(fresh.model).write((1,), host_adapter(llama.adapters["mlp_k_r4"], fresh.model)).wait()

    assert torch.equal(slot_logits(reused, 1), slot_logits(fresh, 1))
    assert not torch.allclose(slot_logits(reused, 1), old)
    assert all(torch.equal(a, b) for a, b in zip(slot_contents(reused, 1), slot_contents(fresh, 1), strict=True))
    assert reused.model.slot_ranks.tolist() == fresh.model.slot_ranks.tolist() == [0, 4]


def test_a_file_in_the_models_dtype_is_used_in_place_and_matches_the_packed_form(llama: TinyCheckpoint):
    directory = llama.adapters["mlp_k_r4"]
    ref = saved_adapter_ref("mlp_k_r4", directory)
    dtypes = (torch.float32, torch.float64)
    limits = {"adapter_root": directory.parent, "info": llama.info, "max_rank": 16, "max_bytes": 1 << 30}
    limits["take"] = fresh_buffers(pin=False)
    # the file's dtype (read in place) and another one (packed)
    read = {dtype: read_host_adapter(ref, dtype=dtype, **limits) for dtype in dtypes}
    weights = (directory / WEIGHTS_FILE).read_bytes()
    data_section = len(weights) - 8 - int.from_bytes(weights[:8], "little")
    assert read[torch.float32].nbytes == data_section  # the file's tensor bytes, nothing repacked
    in_place, packed = read[torch.float32], read[torch.float64]
    assert [(p.layer, p.projection) for p in in_place.parts] == [(p.layer, p.projection) for p in packed.parts]
    for part, other in zip(in_place.parts, packed.parts, strict=True):
        assert torch.equal(in_place.a(part).double(), packed.a(other))
        assert torch.equal(in_place.b(part).double(), packed.b(other))


def test_a_file_whose_tensors_overlap_is_refused(llama: TinyCheckpoint, tmp_path: Path):
    shutil.copytree(llama.adapters["mlp_k_r4"], tmp_path / "mlp_k_r4")
    weights = tmp_path / "mlp_k_r4" / WEIGHTS_FILE
    raw = weights.read_bytes()
    length = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + length])
    first, second = [name for name in sorted(header) if name.endswith("k_proj.lora_A.weight")][:2]  # two layers
    header[second]["data_offsets"] = header[first]["data_offsets"]  # same shape: both read the same bytes
    encoded = json.dumps(header).encode().ljust(length)
    weights.write_bytes(len(encoded).to_bytes(8, "little") + encoded + raw[8 + length :])
    ref = AdapterRef("overlap", 1, "mlp_k_r4", file_digest(weights))

    with pytest.raises(LorafleetError, match="overlap") as raised:
        read_host_adapter(ref, adapter_root=tmp_path, info=llama.info, dtype=torch.float32, max_rank=16,
                          max_bytes=1 << 30, take=fresh_buffers(pin=False))  # fmt: skip
    assert raised.value.code is ErrorCode.ADAPTER_LOAD_FAILED


def test_steps_run_other_requests_while_an_adapter_is_still_on_disk(llama: TinyCheckpoint, monkeypatch):
    disk = threading.Event()  # the disk read may finish only once this is set

    def slow_disk(*args: object, **kwargs: object) -> HostAdapter:
        disk.wait(30)
        return read_host_adapter(*args, **kwargs)

    monkeypatch.setattr(rank_adapter, "read_host_adapter", slow_disk)  # the pool reads through rank_adapter
    engine = make_engine(llama)
    base, adapted = greedy_request(llama, "base", None), greedy_request(llama, "adapted", "all_r8")
    for request in (adapted, base):
        engine.add(request)

    results = {}
    while "base" not in results:
        results.update((r.job_id, r) for r in engine.step())
    assert engine.num_unfinished == 1 and engine.adapter_pool.loads_in_flight == 1
    assert not engine.scheduler.running  # the adapted request waits, admitted nowhere

    disk.set()
    results |= run_to_completion(engine, [])
    assert_matches_oracle(llama, results, {"base": None, "adapted": "all_r8"})


def test_adapters_are_read_to_the_host_while_every_gpu_slot_is_busy(llama: TinyCheckpoint):
    engine = make_engine(llama, max_loras=1)
    pool = engine.adapter_pool
    holder = greedy_request(llama, "holder", "all_r8")  # runs long, pinning the only slot
    holder = dataclasses.replace(holder, sampling=dataclasses.replace(holder.sampling, max_tokens=100))
    first, second = greedy_request(llama, "first", "mlp_k_r4"), greedy_request(llama, "second", "attn_r4_rslora")

    def step_until(condition: object) -> None:
        for _ in range(200):
            if condition():
                return
            engine.step()
            pool.wait(0.05)
        raise AssertionError("condition never held")

    assert engine.add(holder) is None
    step_until(lambda: engine.scheduler.running)
    engine.add(first)
    step_until(lambda: first.adapter.uid in pool.host)
    engine.add(second)  # behind `first`, which is on the host and waits for a slot
    step_until(lambda: second.adapter.uid in pool.host)
    assert [seq.seq_id for seq in engine.scheduler.running] == ["holder"]
    assert engine.abort("holder")
    assert_matches_oracle(llama, run_to_completion(engine, []), {"first": "mlp_k_r4", "second": "attn_r4_rslora"})


def test_a_queued_requests_adapter_is_loaded_while_the_batch_is_full(llama: TinyCheckpoint):
    engine = make_engine(llama, max_num_seqs=1)  # the one batch slot taken by a long base request
    pool = engine.adapter_pool
    holder = greedy_request(llama, "holder", None)
    holder = dataclasses.replace(holder, sampling=dataclasses.replace(holder.sampling, max_tokens=100))
    queued = greedy_request(llama, "queued", "all_r8")
    engine.add(holder)
    engine.step()
    engine.add(queued)  # as the worker hands over every job it has read, runnable or not
    for _ in range(200):
        if pool.gpu.holds(queued.adapter.uid) and not pool.loads_in_flight:
            break
        engine.step()
        pool.wait(0.05)
    assert pool.gpu.holds(queued.adapter.uid) and not pool.loads_in_flight  # loaded ahead of admission
    assert [seq.seq_id for seq in engine.scheduler.running] == ["holder"]
    assert engine.abort("holder")
    assert_matches_oracle(llama, run_to_completion(engine, []), {"queued": "all_r8"})


def test_an_adapter_evicted_from_the_gpu_comes_back_from_the_host_tier(llama: TinyCheckpoint):
    metrics = WorkerMetrics(device="cpu")
    engine = make_engine(llama, max_loras=1, metrics=metrics)
    for job, adapter in [("first", "all_r8"), ("other", "mlp_k_r4"), ("again", "all_r8")]:
        result = run_to_completion(engine, [greedy_request(llama, job, adapter)])[job]
        assert list(result.output.token_ids) == expected_tokens(llama, adapter)

    def sample(name: str, tier: str) -> float:
        return metrics.registry.get_sample_value(name, {"model": llama.info.name, "tier": tier})

    assert sample("lorafleet_worker_adapter_misses_total", "gpu") == 3
    assert sample("lorafleet_worker_adapter_hits_total", "cpu") == 1  # "again": no second disk read
    assert sample("lorafleet_worker_adapter_load_seconds_count", "disk") == 2
    assert sample("lorafleet_worker_adapter_evictions_total", "gpu") == 2


def test_two_versions_of_one_name_run_side_by_side_on_their_own_weights(llama: TinyCheckpoint):
    engine = make_engine(llama)
    v1 = greedy_request(llama, "v1", "all_r8")
    v2 = greedy_request(llama, "v2", "mlp_k_r4")
    v2 = dataclasses.replace(v2, adapter=dataclasses.replace(v2.adapter, name="all_r8", version=2))
    results = run_to_completion(engine, [v1, v2])
    assert v1.adapter.uid != v2.adapter.uid
    assert list(results["v1"].output.token_ids) == expected_tokens(llama, "all_r8")
    assert list(results["v2"].output.token_ids) == expected_tokens(llama, "mlp_k_r4")


def test_a_load_failure_fails_every_request_of_that_adapter_and_no_other(llama: TinyCheckpoint, tmp_path: Path):
    engine = make_engine(llama, tmp_path)  # an empty adapter root: every adapter is missing
    requests = [greedy_request(llama, f"a{i}", "all_r8") for i in range(3)] + [greedy_request(llama, "base", None)]
    results = run_to_completion(engine, requests)
    assert [results[f"a{i}"].error.code for i in range(3)] == ["adapter_load_failed"] * 3
    assert results["base"].status is JobStatus.SUCCEEDED
    # the free slot list alone: nothing is kept of the failed adapter
    assert engine.adapter_pool.bookkeeping_size() == engine.config.max_loras


def test_an_adapter_whose_read_failed_gets_no_second_read_in_the_same_poll(llama: TinyCheckpoint, tmp_path: Path):
    # a second request for it arrives while its read fails: the poll that reports the failure (and so
    # fails both requests) must not start another read for an adapter nobody will be waiting for
    engine = make_engine(llama, tmp_path, max_loras=8)
    pool = engine.adapter_pool  # driven here without engine steps
    ref = saved_adapter_ref("all_r8", llama.adapters["all_r8"])  # not under tmp_path: its read fails
    pool.request(ref)
    assert pool.poll() == []  # the read starts
    pool.wait(10.0)
    pool.request(ref)
    assert [failure.uid for failure in pool.poll()] == [ref.uid]
    assert pool.loads_in_flight == 0
    pool.drop(ref.uid)
    pool.drop(ref.uid)
    assert pool.bookkeeping_size() == engine.config.max_loras  # the free slot list alone
    pool.close()


def test_a_valid_adapter_file_replaced_after_registration_is_never_served(llama: TinyCheckpoint, tmp_path: Path):
    shutil.copytree(llama.adapters["all_r8"], tmp_path / "all_r8")
    request = greedy_request(llama, "stale", "all_r8")  # carries the registered digest
    weights = tmp_path / "all_r8" / WEIGHTS_FILE
    save_file({name: tensor * 2 for name, tensor in load_file(weights).items()}, str(weights))  # still valid PEFT

    result = run_to_completion(make_engine(llama, tmp_path), [request])["stale"]

    assert result.error.code == "adapter_load_failed" and "changed since registration" in result.error.message


def test_a_host_tier_smaller_than_one_adapter_per_gpu_slot_is_refused_at_start(llama: TinyCheckpoint):
    with pytest.raises(ValueError, match="adapter_host_cache_gb=1e-06 holds fewer adapters than max_loras=4"):
        make_engine(llama, max_loras=4, adapter_host_cache_gb=1e-6)


def test_a_full_host_arena_evicts_least_recently_used_and_serves_the_same_tokens(llama: TinyCheckpoint):
    largest = max_adapter_bytes(llama.info, max_rank=8, dtype=torch.float32)  # all_r8's size
    # one section: the two rank-4 adapters share it, all_r8 needs all of it
    engine = make_engine(llama, dtype="float32", max_loras=1, adapter_host_cache_gb=largest / (1 << 30))
    pool = engine.adapter_pool
    assert pool.arena.allocator.sections == 1
    resident = []
    for index, name in enumerate(["mlp_k_r4", "attn_r4_rslora", "all_r8", "mlp_k_r4"]):
        job = f"job-{index}"
        assert_matches_oracle(llama, run_to_completion(engine, [greedy_request(llama, job, name)]), {job: name})
        resident.append([uid.partition("@")[0] for uid in pool.host.resident])
        assert pool.arena.allocator.used_bytes == pool.host.nbytes  # every host entry one block, nothing else
    assert resident == [["mlp_k_r4"], ["mlp_k_r4", "attn_r4_rslora"], ["all_r8"], ["mlp_k_r4"]]
    assert pool.arena.allocator.bookkeeping_size() == len(pool.host) == 1
    pool.close()


@pytest.mark.parametrize("device", DEVICES)
def test_a_load_goes_from_disk_into_the_host_arena_and_from_there_to_the_gpu(llama: TinyCheckpoint, device: str):
    root = llama.adapters["all_r8"].parent
    settings = {"device": device, "dtype": "float32", "max_loras": 2, "max_lora_rank": 16}
    engine = load_engine(llama.model_dir, root, num_kv_blocks=16, block_size=4, **settings)
    pool = engine.adapter_pool
    ref = saved_adapter_ref("all_r8", llama.adapters["all_r8"])
    pool.request(ref)
    while pool.gpu.slot_of(ref.uid) is None:
        assert pool.poll() == []
        pool.wait(1.0)
    arena, host = pool.arena.buffer, pool.host.get(ref.uid)
    assert arena.data_ptr() <= host.buffer.data_ptr() < arena.data_ptr() + arena.numel()
    assert arena.is_pinned() == host.buffer.is_pinned() == (device == "cuda")  # page-locked once, on CUDA

    expected = make_runner(llama, device)  # the same adapter written from a buffer of its own
    slot = pool.gpu.slot_of(ref.uid)
    SlotWriter(expected.model).write((slot,), host_adapter(llama.adapters["all_r8"], expected.model)).wait()
    assert torch.equal(slot_logits(engine.runner, slot), slot_logits(expected, slot))
    pool.drop(ref.uid)
    pool.close()
