"""A runner built with a capture pacer leaves the preparation's timeline: every stretch of its
build by kind, in order, closed when the runner is built (issue #27's overlap bench reads it)."""

from __future__ import annotations

import itertools

import pytest
import torch

from tests.engine.test_engine_generation import make_engine
from tests.engine.tiny_hf import TinyCheckpoint
from worker.engine.capture_pacer import CapturePacer
from worker.engine.model_runner import ModelRunner
from worker.memory_plan import kv_storage_bytes, model_footprint


def rebuilt_with_pacer(checkpoint: TinyCheckpoint, device: str) -> CapturePacer:
    """A second runner of a loaded engine's model, built with a pacer that never rests (the model
    beside it has no request), as ModelResidency.prepare builds one beside a serving model."""
    runner = make_engine(checkpoint, device=device, max_num_seqs=4, max_num_batched_tokens=64).runner
    config = runner.config
    storage = torch.zeros(
        kv_storage_bytes(model_footprint(runner.info, config), runner.num_blocks, config),
        dtype=torch.uint8,
        device=device,
    )
    pacer = CapturePacer(serving=lambda: False)
    ModelRunner(runner.model, config, storage, runner.num_blocks, pacer=pacer)
    return pacer


def test_a_cpu_runner_records_its_kv_carve_and_closes_the_timeline(llama: TinyCheckpoint):
    pacer = rebuilt_with_pacer(llama, "cpu")
    assert [interval.kind for interval in pacer.timeline] == ["kv carve"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_cuda_runner_records_every_stretch_of_its_captures_in_order(llama: TinyCheckpoint):
    pacer = rebuilt_with_pacer(llama, "cuda")
    timeline = pacer.timeline
    kinds = [interval.kind for interval in timeline]
    piecewise_end = kinds.index("decode setup")
    assert kinds[:4] == ["kv carve", "piece setup", "gc.collect", "piece warm-up"]
    assert set(kinds[3:piecewise_end]) == {"piece warm-up", "piece capture", "graph instantiate"}
    assert kinds[piecewise_end : piecewise_end + 3] == ["decode setup", "gc.collect", "decode warm-up"]
    assert set(kinds[piecewise_end + 2 :]) == {"decode warm-up", "decode capture", "graph instantiate"}
    assert kinds[-2:] == ["decode capture", "graph instantiate"]
    assert all(kind == "graph instantiate" for before, kind in itertools.pairwise(kinds) if "capture" in before)
    assert all(a.end == b.start for a, b in itertools.pairwise(timeline)), "stretches leave gaps"
