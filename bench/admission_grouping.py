"""Adapter grouping at saturation (issue #20): distinct adapters per step, and who waits for it.

    python -m bench.admission_grouping [--overtakes 0 32] [--clients 128 256] [--steps 1500] [--out FILE]

bench.e2e's llama3-8b traffic and engine sizes (100 adapters, Zipf(1.0) over them, 256-token prompts,
128 output tokens, max_num_seqs 128, 64 adapter slots, 2,048 tokens a step) served by an in-process
LLMEngine over a tiny model on the CPU, built as a worker builds it. A closed loop keeps `--clients`
requests in the engine: each one that finishes is replaced by a new Zipf draw before the next step.
`--clients` 128 is the stack's own calibration (bench.e2e keeps max_num_seqs requests in flight:
almost none waits in the engine); 256 is the most a worker holds (worker/running_jobs.py: twice
max_num_seqs), the deepest queue the served engine can have. Each --overtakes value is the worker's
--max-grouping-overtakes (0: first-come first-served).

Time is counted in engine steps: a CPU's step times say nothing of a GPU's, and steps make runs
comparable (to read them as time, multiply by a GPU's step time at the same batch). After the first
--warmup-steps (the initial burst drains), --steps are measured: the mean sequences and distinct
adapters per step, and the time to first token (arrival → the step that produced the first token,
in steps) of the requests that arrived in the measured window, for the popular adapters (ranks
1-10, ~56% of the traffic), the middle (11-50) and the rare ones (51-100, ~13%).
Written to --out (JSON lines): one line per (clients, overtakes).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from prometheus_client import CollectorRegistry

from bench.e2e.assets import BenchAdapter, adapter_specs, write_adapters, write_model
from bench.e2e.engine_alone import on_engine_thread
from bench.e2e.presets import PRESETS
from bench.e2e.traffic import zipf_weights
from bench.e2e.worker_metrics import difference, read_registry
from shared.adapter_digest import file_digest
from shared.adapter_format import WEIGHTS_FILE
from shared.config import EngineConfig, ModelSpec, WorkerConfig
from shared.schema import AdapterRef, SamplingParams
from worker.engine.engine import LLMEngine
from worker.engine.engine_request import EngineRequest
from worker.metrics import WorkerMetrics
from worker.switching.residency import ModelResidency

GROUPS = {"popular": (1, 10), "middle": (11, 50), "rare": (51, 100)}  # popularity ranks, inclusive

# bench.e2e's llama3-8b traffic and engine sizes over its tiny preset's model, with room for the context
PRESET = dataclasses.replace(
    PRESETS["tiny"],
    name="grouping",
    # one layer: the scheduler and the adapter pool are what is measured, and the CPU's step halves
    shape=dataclasses.replace(PRESETS["tiny"].shape, num_layers=1, max_position_embeddings=512),
    num_adapters=100,
    lora_rank=16,
    num_tenants=4,
    prompt_tokens=256,
    output_tokens=128,
    engine=EngineConfig(
        device="cpu", max_num_seqs=128, max_loras=64, max_lora_rank=16, block_size=16, num_kv_blocks=128 * 24 + 64
    ),
)


@dataclass(slots=True)
class Request:
    rank: int  # its adapter's popularity rank
    arrival_step: int
    first_token_step: int | None = None


@dataclass(frozen=True, slots=True)
class GroupWait:
    requests: int
    ttft_p50_steps: float
    ttft_p99_steps: float
    ttft_max_steps: int


@dataclass(frozen=True, slots=True)
class RunRow:
    clients: int
    overtakes: int
    steps: int
    seqs_per_step: float
    adapters_per_step: float
    waiting_per_step: float  # sequences waiting in the engine after each step's scheduling
    adapter_loads: int  # adapters brought into a device slot (misses of the GPU tier)
    groups: dict[str, GroupWait]  # GROUPS, and "all"


class ClosedLoop:
    """`clients` requests in the engine at all times, Zipf(α) over `adapters`."""

    def __init__(
        self, engine: LLMEngine, registry: CollectorRegistry, adapters: list[tuple[BenchAdapter, AdapterRef]], seed: int
    ) -> None:
        """`registry`: the engine's metrics."""
        self.engine = engine
        self.registry = registry
        self.adapters = adapters
        self.weights = zipf_weights(len(adapters), PRESET.zipf_alpha)
        self.rng = random.Random(seed)
        self.requests: dict[str, Request] = {}

    def add(self, step: int) -> None:
        adapter, ref = self.rng.choices(self.adapters, weights=self.weights)[0]
        job_id = str(len(self.requests))
        prompt = tuple(self.rng.randrange(PRESET.vocab_size - 2) for _ in range(PRESET.prompt_tokens))
        sampling = SamplingParams(max_tokens=PRESET.output_tokens, temperature=0.0, ignore_eos=True)
        request = EngineRequest(job_id, prompt, sampling, tenant=adapter.tenant, adapter=ref, stream=True)
        self.requests[job_id] = Request(adapter.popularity_rank, step)
        if self.engine.add(request) is not None:
            raise RuntimeError(f"request {job_id} refused")

    def run(self, clients: int, warmup_steps: int, steps: int, overtakes: int) -> RunRow:
        # the batch fills over one request's output and the queue behind it once the batch is full, so requests
        # finish (and are replaced) at an even pace as in a steady state: started together, or the queue with
        # the batch, requests of equal length would keep finishing in waves
        batch = min(clients, PRESET.engine.max_num_seqs)
        starts = [i * PRESET.output_tokens // batch for i in range(batch)] + [PRESET.output_tokens] * (clients - batch)
        seqs, adapters, waiting = [], [], []
        before = read_registry(self.registry)
        for step in range(warmup_steps + steps):
            while starts and starts[0] == step:
                starts.pop(0)
                self.add(step)
            if step == warmup_steps:
                before = read_registry(self.registry)
            finished = self.engine.step()
            for delta in self.engine.take_deltas():
                request = self.requests[delta.job_id]
                if request.first_token_step is None:
                    request.first_token_step = step
            if step >= warmup_steps:
                seqs.append(self.engine.last_step.num_seqs)
                adapters.append(self.engine.last_step.num_adapters)
                waiting.append(len(self.engine.scheduler.waiting))
            for result in finished:
                if result.status.value != "succeeded":
                    raise RuntimeError(f"request {result.job_id} {result.status.value}: {result.error}")
                self.add(step + 1)
        loads = difference(before, read_registry(self.registry)).adapter_loads
        measured = [
            r for r in self.requests.values() if r.arrival_step >= warmup_steps and r.first_token_step is not None
        ]
        groups = {name: _wait([r for r in measured if low <= r.rank <= high]) for name, (low, high) in GROUPS.items()}
        return RunRow(
            clients=clients,
            overtakes=overtakes,
            steps=steps,
            seqs_per_step=float(np.mean(seqs)),
            adapters_per_step=float(np.mean(adapters)),
            waiting_per_step=float(np.mean(waiting)),
            adapter_loads=loads,
            groups=groups | {"all": _wait(measured)},
        )


def _wait(requests: list[Request]) -> GroupWait:
    ttft = [r.first_token_step - r.arrival_step for r in requests]
    if not ttft:
        return GroupWait(0, float("nan"), float("nan"), 0)
    return GroupWait(len(ttft), float(np.percentile(ttft, 50)), float(np.percentile(ttft, 99)), max(ttft))


def build_engine(workdir: Path, overtakes: int) -> tuple[LLMEngine, CollectorRegistry]:
    """The engine a worker with --max-grouping-overtakes `overtakes` builds, and its metrics."""
    config = WorkerConfig(
        redis_url="redis://unused",  # the residency never talks to Redis
        models=(ModelSpec(PRESET.name, workdir / "model"),),
        adapter_root=workdir / "adapters",
        engine=dataclasses.replace(PRESET.engine, max_grouping_overtakes=overtakes),
    )
    metrics = WorkerMetrics("cpu")
    residency = ModelResidency(config, metrics)
    return residency.activate(residency.prepare(PRESET.name)), metrics.registry


def write_assets(workdir: Path) -> list[tuple[BenchAdapter, AdapterRef]]:
    specs = adapter_specs(PRESET)
    if not (workdir / "model").exists():
        info = write_model(workdir / "model", PRESET, torch.device("cpu"))
        write_adapters(workdir / "adapters", specs, info, PRESET, workdir / "model", torch.device("cpu"))
    return [
        (spec, AdapterRef(spec.name, 1, spec.path, file_digest(workdir / "adapters" / spec.path / WEIGHTS_FILE)))
        for spec in specs
    ]


def table(rows: list[RunRow]) -> str:
    lines = [
        "| clients | max overtakes | seqs/step | adapters/step | waiting/step | adapter loads "
        "| TTFT steps p50 / p99 / max: popular | middle | rare | all |",
        "| ---: " * 6 + "| ---: " * 4 + "|",
    ]
    for r in rows:
        waits = " | ".join(
            f"{g.ttft_p50_steps:.0f} / {g.ttft_p99_steps:.0f} / {g.ttft_max_steps}" for g in r.groups.values()
        )
        lines.append(
            f"| {r.clients} | {r.overtakes} | {r.seqs_per_step:.1f} | {r.adapters_per_step:.1f} "
            f"| {r.waiting_per_step:.1f} | {r.adapter_loads} | {waits} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--overtakes", type=int, nargs="+", default=[0, PRESET.engine.grouping_overtakes])
    parser.add_argument("--clients", type=int, nargs="+", default=[128, 256], help="requests kept in the engine")
    parser.add_argument("--warmup-steps", type=int, default=512, help="steps before the measured ones")
    parser.add_argument("--steps", type=int, default=1500, help="measured steps per run")
    parser.add_argument("--seed", type=int, default=0, help="of the Zipf draws and prompts (the same every run)")
    parser.add_argument("--workdir", type=Path, help="model and adapters, reused when present (default: a temp dir)")
    parser.add_argument("--out", type=Path, help="JSON lines, one per run")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # the engine thread alone: steady step times on a shared machine
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="lorafleet-grouping-"))
    adapters = write_assets(workdir)
    rows = []
    for clients in args.clients:
        for overtakes in args.overtakes:
            engine, registry = build_engine(workdir, overtakes)
            loop = ClosedLoop(engine, registry, adapters, args.seed)
            rows.append(on_engine_thread(lambda: loop.run(clients, args.warmup_steps, args.steps, overtakes)))  # noqa: B023
            engine.adapter_pool.close()
            print(table(rows[-1:]).splitlines()[-1], flush=True)
            if args.out:
                with args.out.open("a") as f:
                    f.write(json.dumps(dataclasses.asdict(rows[-1])) + "\n")
    print(f"\n{PRESET.num_adapters} adapters Zipf({PRESET.zipf_alpha}), prompt {PRESET.prompt_tokens}, output "
          f"{PRESET.output_tokens}, max_num_seqs {PRESET.engine.max_num_seqs}, max_loras {PRESET.engine.max_loras}, "
          f"{args.steps} steps after {args.warmup_steps}")  # fmt: skip
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
