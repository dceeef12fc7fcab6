"""The whole stack under load: Zipf adapter traffic and base-only traffic at three offered loads.

    python -m bench.e2e [--preset llama3-8b] [--out DIR] [--workdir DIR] [--budget-s 400] [--run-s 15] [--loads RPS ...]
                        [--max-grouping-overtakes N] [--heat-alone]

The `tiny` preset runs the same phases on the CPU in seconds (its worker: `--device cpu`).

1. Assets: the preset's model (random weights, HF format) and adapters written under --workdir.
2. The stack: Redis, the worker, the gateways (bench/e2e/stack.py); tenants and adapters registered.
3. Warm-up: a request for every adapter, then a burst of Zipf requests (Triton compiles, every
   adapter read once into the host tier, GPU slots filled): the runs measure the steady state.
4. Calibration: per mode, a closed loop keeping max_num_seqs requests in flight (its lanes start
   over the first third); the output tok/s of its second half, over the output length, is the
   mode's saturation in requests/s.
5. Load runs: open-loop Poisson arrivals at three offered loads, from 60% of the slower mode's
   saturation up to 95% of the faster one's (or at --loads); at each load base-only, then Zipf over
   all adapters (the same arrival times).
6. Engine alone: the stack is stopped and the lowest load's base-only requests are replayed into an
   in-process LLMEngine; the p50 differences are what the gateway, Redis and the worker's I/O add,
   and the mean step times (stack's worker vs engine alone, same load) what the engine loses inside
   the worker process. The last table splits both runs' latency stage by stage (bench/e2e/stages.py):
   where the stack's added time goes. With --heat-alone the engine first runs a closed loop as long
   as the two calibrations (not measured), so that the replay starts from the device state the
   stack's first load run started from rather than from an idle device.

Every phase checks the time left in --budget-s first and is skipped if it cannot finish, so the
table always prints. Every run samples the device once a second (utilisation, clocks, power,
temperature, clock slowdowns: bench/e2e/device_clocks.py), the replay too, so a step slower in the
stack can be told from a device running slower. Written to --out: e2e.jsonl (one line per run, the
targets, the stages, then one line per reading, `t_s` on the run's clock), e2e_requests.csv (one line
per request), e2e_load.png and e2e_timeline.png.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import dataclasses
import json
import resource
import tempfile
import time
import traceback
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from bench.e2e.assets import adapter_specs, write_adapters, write_model
from bench.e2e.client import LoadClient, RunRecord, Sample
from bench.e2e.device_clocks import Probe, device_probe, sampled_each_second
from bench.e2e.engine_alone import keep_busy, on_engine_thread, replay, run_to_completion
from bench.e2e.floor import AdapterFloor, adapter_floor
from bench.e2e.plots import plot_load, plot_timeline
from bench.e2e.presets import PRESETS, Preset
from bench.e2e.stack import Stack, start_stack
from bench.e2e.stages import StageRow, engine_points, stack_points, stage_rows, stage_table
from bench.e2e.summary import (
    RunSummary,
    Verdict,
    clocks_table,
    summarize,
    table,
    verdict_table,
    verdicts,
    window_tok_s,
    worker_table,
)
from bench.e2e.traffic import Mode, PlannedRequest, RequestSource, TrafficShape, poisson_plan, zipf_weights
from bench.e2e.worker_metrics import difference, read_registry
from shared.adapter_format import WEIGHTS_FILE
from shared.config import ModelSpec, WorkerConfig
from shared.schema import JobTrace
from worker.metrics import WorkerMetrics
from worker.switching.residency import ModelResidency

LOW_FRACTION = 0.6  # the lowest offered load, of the slower mode's saturation
HIGH_FRACTION = 0.95  # the highest, of the faster mode's: near saturation
_STOP_RESERVE_S = 30.0  # stopping the stack and writing the results
_WARMUP_WAIT_S = 180.0  # the first requests on a fresh machine wait for Triton to compile every kernel


class Budget:
    def __init__(self, seconds: float) -> None:
        self.deadline = time.monotonic() + seconds

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def allows(self, seconds: float, what: str) -> bool:
        if self.left() - _STOP_RESERVE_S >= seconds:
            return True
        print(f"skipped {what}: needs ~{seconds:.0f} s, {self.left():.0f} s left", flush=True)
        return False


@dataclass(slots=True)
class LoadRun:
    row: RunSummary
    record: RunRecord
    plan: list[PlannedRequest]
    traces: dict[str, JobTrace]  # by job id: each request's way through the worker


def offered_loads(capacity_rps: dict[str, float]) -> list[float]:
    low, high = LOW_FRACTION * min(capacity_rps.values()), HIGH_FRACTION * max(capacity_rps.values())
    return [low, (low + high) / 2, high]


class Bench:
    def __init__(
        self, preset: Preset, workdir: Path, out: Path, budget: Budget, fixed_loads: list[float] | None = None,
        heat_alone: bool = False,
    ) -> None:  # fmt: skip
        """`fixed_loads`: the load runs' offered req/s, instead of fractions of the calibrated saturation;
        `heat_alone`: a closed loop on the engine alone before its replay, as long as the calibrations."""
        self.preset = preset
        self.fixed_loads = fixed_loads
        self.heat_alone = heat_alone
        self.workdir = workdir
        self.out = out
        self.budget = budget
        self.model = ModelSpec(preset.name, workdir / "model")
        self.adapter_root = workdir / "adapters"
        self.adapters = adapter_specs(preset)
        self.rows: list[RunSummary] = []
        self.loads: list[LoadRun] = []
        self.samples: list[tuple[RunSummary, list[Sample]]] = []
        self.probes: list[tuple[RunSummary, list[tuple[float, Probe]]]] = []  # (s since the run's start, reading)
        self.capacity_rps: dict[str, float] = {}
        self.notes: dict[str, float | str] = {"device": _device_name(preset), "preset": preset.name}
        self.bandwidth = _copy_bandwidth(preset)  # bytes/s; measured before the worker takes the GPU
        self.floor: AdapterFloor | None = None
        self.stages: tuple[list[StageRow], int, int] | None = None  # (rows, stack requests, alone requests)

    def shape(self, mode: Mode) -> TrafficShape:
        p = self.preset
        return TrafficShape(mode, self.adapters, p.num_tenants, p.zipf_alpha, p.vocab_size, p.prompt_tokens,
                            p.output_tokens)  # fmt: skip

    def timed(self, what: str, since: float) -> None:
        self.notes[f"{what}_s"] = round(time.monotonic() - since, 1)
        print(f"{what}: {self.notes[f'{what}_s']} s", flush=True)

    def write_assets(self) -> None:
        started = time.monotonic()
        device = torch.device(self.preset.engine.device)
        info = write_model(self.model.path, self.preset, device)
        write_adapters(self.adapter_root, self.adapters, info, self.preset, self.model.path, device)
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the worker needs the memory the draws used
        self.timed("assets", started)

    def serve(self) -> None:
        """Phases 2-5 on the running stack."""
        started = time.monotonic()
        log_dir = self.workdir / "logs"
        log_dir.mkdir(exist_ok=True)
        p = self.preset
        stack = start_stack(self.workdir, log_dir, self.model, self.adapter_root, self.adapters, p.num_tenants,
                            p.engine, p.gateways)  # fmt: skip
        self.timed("stack_start", started)
        try:
            client = LoadClient(stack.gateway_urls, stack.api_keys, self.model.name)
            started = time.monotonic()
            warmup = RequestSource(self.shape(Mode.ZIPF), seed=1)
            # every adapter once, so each has been read from disk into the host tier (the cold path
            # is bench.adapter_pool's), then a Zipf burst; in waves of a full batch, which the
            # stack admits (1,000 adapters at once: most were refused, and calibration read them)
            burst = [warmup.draw(i, 0.0, adapter) for i, adapter in enumerate(self.adapters)]
            burst += [warmup.draw(len(burst) + i, 0.0) for i in range(p.warmup_requests)]
            wave = p.engine.max_num_seqs
            failed: Counter[str] = Counter()
            for first in range(0, len(burst), wave):
                record = asyncio.run(client.open_loop(burst[first : first + wave], _WARMUP_WAIT_S, stack.probe))
                failed.update(s.status for s in record.samples if not s.ok)
            self.timed("warmup", started)
            failures = f"{failed.total()} failed {dict(failed)}"
            print(f"warmup: {len(burst)} requests in waves of {wave}, {failures}", flush=True)
            self.calibrate(client, stack)
            for index, load in enumerate(self.fixed_loads or offered_loads(self.capacity_rps)):
                for mode in (Mode.BASE, Mode.ZIPF):
                    if not self.budget.allows(p.run_s + p.drain_s + 5, f"{mode} at {load:.1f} req/s"):
                        return
                    self.load_run(client, stack, mode, load, seed=100 + index)
        finally:
            started = time.monotonic()
            stack.stop()
            self.timed("stack_stop", started)

    def calibrate(self, client: LoadClient, stack: Stack) -> None:
        p = self.preset
        for seed, mode in enumerate((Mode.ZIPF, Mode.BASE), start=10):
            source = RequestSource(self.shape(mode), seed)
            before = stack.worker_metrics()
            record = asyncio.run(
                client.closed_loop(source.endless(), p.engine.max_num_seqs, p.calibration_s, stack.probe)
            )
            tok_s = window_tok_s(record.token_times_s, p.calibration_s / 2, p.calibration_s)
            self.capacity_rps[mode] = tok_s / p.output_tokens
            worker = difference(before, stack.worker_metrics())
            row = summarize("calibration", mode, 0.0, record.samples, probes=record.probes, worker=worker)
            self.rows.append(dataclasses.replace(row, output_tok_s=tok_s))
            self.samples.append((self.rows[-1], record.samples))
            self.probes.append((self.rows[-1], record.probes))
            print(f"calibration {mode}: {tok_s:.0f} tok/s = {self.capacity_rps[mode]:.2f} req/s", flush=True)
        calibrated = {r.mode: r.worker for r in self.rows if r.phase == "calibration"}
        zipf, base = calibrated.get(Mode.ZIPF), calibrated.get(Mode.BASE)
        if self.bandwidth and zipf is not None and base is not None:
            weights_file = self.adapter_root / self.adapters[0].path / WEIGHTS_FILE
            weights = zipf_weights(p.num_adapters, p.zipf_alpha)
            self.floor = adapter_floor(
                weights, zipf.batch_seqs, weights_file.stat().st_size, self.bandwidth, base.step_ms
            )
            print(f"calibration: {self.floor.describe()}", flush=True)

    def load_run(self, client: LoadClient, stack: Stack, mode: Mode, load: float, seed: int) -> None:
        p = self.preset
        plan = poisson_plan(self.shape(mode), load, p.run_s, seed)
        before = stack.worker_metrics()
        record = asyncio.run(client.open_loop(plan, p.drain_s, stack.probe))
        worker = difference(before, stack.worker_metrics())
        succeeded = [s.job_id for s in record.samples if s.ok]
        job_times = stack.job_times(succeeded)
        row = summarize("load", mode, load, record.samples, start_unix_s=record.start_unix_s, job_times=job_times,
                        probes=record.probes, worker=worker)  # fmt: skip
        self.rows.append(row)
        self.loads.append(LoadRun(row, record, plan, stack.traces(succeeded)))
        self.samples.append((row, record.samples))
        self.probes.append((row, record.probes))
        print(_row_line(row), flush=True)

    def engine_alone(self) -> tuple[RunSummary, RunSummary] | None:
        """Replay the lowest load's base-only requests into an in-process engine; (stack row, engine row)."""
        base = sorted((run for run in self.loads if run.row.mode == Mode.BASE), key=lambda run: run.row.offered_rps)
        if not base:
            return None
        stack_run = base[0]
        load_s = float(self.notes.get("stack_start_s", 60.0))
        heat_s = 2 * self.preset.calibration_s if self.heat_alone else 0.0  # both modes' calibrations
        if not self.budget.allows(load_s + heat_s + self.preset.run_s + 10, "the engine-alone replay"):
            return None
        started = time.monotonic()
        # built as a worker builds it (one resident model), the stack's worker having stopped
        metrics = WorkerMetrics(self.preset.engine.device)
        residency = ModelResidency(
            WorkerConfig(redis_url="redis://unused", models=(self.model,), adapter_root=self.adapter_root,
                         engine=self.preset.engine),
            metrics,
        )  # fmt: skip
        engine = residency.activate(residency.prepare(self.model.name))
        source = RequestSource(self.shape(Mode.BASE), seed=2)
        # compiled kernels come from Triton's disk cache; this fills the process's own caches
        warmup = [source.draw(i, 0.0) for i in range(self.preset.engine.max_num_seqs // 4)]
        on_engine_thread(lambda: run_to_completion(engine, warmup))
        self.timed("engine_load", started)
        if heat_s:
            started = time.monotonic()
            heat = RequestSource(self.shape(Mode.BASE), seed=3).endless()  # not the warm-up's prompts again
            on_engine_thread(lambda: keep_busy(engine, heat, self.preset.engine.max_num_seqs, heat_s))
            self.timed("engine_heat", started)
        before = read_registry(metrics.registry)
        # the device read once a second as the stack's worker is scraped: the same collector, its registry
        # rendered on a thread of this process beside the engine's, as the worker renders it beside its own
        with sampled_each_second(lambda: device_probe(read_registry(metrics.registry))) as readings:
            alone = on_engine_thread(lambda: replay(engine, stack_run.plan))
        worker = difference(before, read_registry(metrics.registry))  # its steps, as the stack's worker counts them
        probes = [(unix_s - alone.start_unix_s, probe) for unix_s, probe in readings]  # on the replay's clock
        row = summarize("engine-alone", Mode.BASE, stack_run.row.offered_rps, alone.samples, probes=probes,
                        worker=worker)  # fmt: skip
        self.rows.append(row)
        self.samples.append((row, alone.samples))
        self.probes.append((row, probes))
        print(_row_line(row), flush=True)
        stack_points_ = stack_points(stack_run.record.samples, stack_run.traces, stack_run.record.start_unix_s)
        alone_points = engine_points(alone.samples, alone.results, alone.start_unix_s)
        self.stages = (stage_rows(stack_points_, alone_points), len(stack_points_), len(alone_points))
        return stack_run.row, row

    def write_results(self, found: list[Verdict]) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        with (self.out / "e2e.jsonl").open("w") as f:
            meta = {
                "kind": "meta",
                **self.notes,
                "capacity_rps": self.capacity_rps,
                "preset_config": _preset_dict(self.preset),
            }
            f.write(json.dumps(meta) + "\n")
            for row in self.rows:
                f.write(json.dumps({"kind": "run", **asdict(row)}) + "\n")
            for verdict in found:
                f.write(json.dumps({"kind": "target", **asdict(verdict)}) + "\n")
            for stage in self.stages[0] if self.stages else ():
                f.write(json.dumps({"kind": "stage", **asdict(stage)}) + "\n")
            # the once-a-second readings, on the run's clock (t_s): e2e_requests.csv's times line up with them
            for row, probes in self.probes:
                for t_s, probe in probes:
                    line = {"kind": "probe", "phase": row.phase, "mode": row.mode, "offered_rps": row.offered_rps}
                    f.write(json.dumps({**line, "t_s": round(t_s, 3), **probe}) + "\n")
        with (self.out / "e2e_requests.csv").open("w", newline="") as f:
            writer = csv.writer(f)
            fields = [field.name for field in dataclasses.fields(Sample)]
            writer.writerow(["phase", "mode", "offered_rps", *fields])
            for row, samples in self.samples:
                for sample in samples:
                    writer.writerow([row.phase, row.mode, f"{row.offered_rps:.3f}", *astuple_sample(sample)])
        if self.rows:
            plot_load(self.rows, self.preset.output_tokens, self.out / "e2e_load.png")
        if self.loads:
            plot_timeline([(run.row, run.record) for run in self.loads], self.out / "e2e_timeline.png")


def astuple_sample(sample: Sample) -> list:
    return [getattr(sample, field.name) for field in dataclasses.fields(Sample)]


def _device_name(preset: Preset) -> str:
    device = torch.device(preset.engine.device)
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def _copy_bandwidth(preset: Preset) -> float | None:
    """The device's copy bandwidth (bytes/s, read + write) for the byte floor; None on a CPU."""
    if torch.device(preset.engine.device).type != "cuda":
        return None
    from bench.lora_kernels import copy_bandwidth  # Triton's timing helpers: GPU runs only

    bandwidth = copy_bandwidth()
    torch.cuda.empty_cache()
    return bandwidth


def _preset_dict(preset: Preset) -> dict:
    return json.loads(json.dumps(asdict(preset), default=str))


def _row_line(row: RunSummary) -> str:
    clocks = "" if row.clocks is None else f", SM {row.clocks.sm_clock_mhz:.0f} MHz, {row.clocks.power_w:.0f} W"
    return (
        f"{row.phase} {row.mode} offered {row.offered_rps:.2f} req/s: {row.requests} requests, {row.failed} failed, "
        f"{row.output_tok_s:.0f} tok/s, TTFT p50/p99 {row.ttft_p50_ms:.0f}/{row.ttft_p99_ms:.0f} ms, latency "
        f"p50/p99 {row.latency_p50_ms:.0f}/{row.latency_p99_ms:.0f} ms, GPU {row.gpu_util_pct:.0f}%{clocks}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="llama3-8b")
    parser.add_argument("--out", type=Path, default=Path("e2e-out"), help="results and plots (default: %(default)s)")
    parser.add_argument("--workdir", type=Path, help="model, adapters, Redis data, logs (default: a new temp dir)")
    parser.add_argument("--budget-s", type=float, default=400.0, help="wall-clock budget (default: %(default)s)")
    parser.add_argument("--run-s", type=float, help="seconds of arrivals per load run (default: the preset's)")
    parser.add_argument(
        "--loads", type=float, nargs="+", metavar="RPS",
        help="offered loads of the load runs, req/s (default: from the calibrated saturation); the same loads "
        "on every run make runs of two versions comparable",
    )  # fmt: skip
    parser.add_argument(
        "--max-grouping-overtakes", type=int, metavar="N",
        help="the worker's --max-grouping-overtakes (0: admission in arrival order; default: the worker's, a "
        "quarter of max_num_seqs), so that one machine can run the bench with adapter grouping and without",
    )  # fmt: skip
    parser.add_argument(
        "--heat-alone", action="store_true",
        help="before the engine-alone replay, keep the engine busy in a closed loop as long as the two "
        "calibrations (not measured), so that it starts from the device state the stack's load runs start from",
    )  # fmt: skip
    args = parser.parse_args(argv)
    preset = PRESETS[args.preset]
    if args.run_s is not None:
        preset = dataclasses.replace(preset, run_s=args.run_s)
    if args.max_grouping_overtakes is not None:
        engine = dataclasses.replace(preset.engine, max_grouping_overtakes=args.max_grouping_overtakes)
        preset = dataclasses.replace(preset, engine=engine)
    # an overloaded run holds two sockets per request in flight, here and in the gateways and Redis
    # (children inherit the limit): lift the soft limit on open files to the hard one
    resource.setrlimit(resource.RLIMIT_NOFILE, (resource.getrlimit(resource.RLIMIT_NOFILE)[1],) * 2)
    budget = Budget(args.budget_s)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="lorafleet-e2e-"))
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"workdir {workdir}", flush=True)
    overhead = None
    bench = Bench(preset, workdir, args.out, budget, args.loads, args.heat_alone)
    try:
        bench.write_assets()
        bench.serve()
        overhead = bench.engine_alone()
    except Exception:  # report what was measured before the failure, then fail
        traceback.print_exc()
    found = verdicts(bench.rows, bench.capacity_rps, overhead, preset.saturation_target, bench.floor)
    bench.write_results(found)
    print(
        f"\n{preset.name} on {bench.notes['device']}: prompt {preset.prompt_tokens} tokens, output "
        f"{preset.output_tokens} tokens, {preset.num_adapters} adapters r{preset.lora_rank} Zipf "
        f"α={preset.zipf_alpha}, max_num_seqs {preset.engine.max_num_seqs}, max_loras {preset.engine.max_loras}, "
        f"max_grouping_overtakes {preset.engine.grouping_overtakes}"
    )
    print(table(bench.rows, preset.output_tokens))
    print()
    print(worker_table(bench.rows))
    print()
    if any(row.clocks is not None for row in bench.rows):
        print(clocks_table(bench.rows))
        print()
    print(verdict_table(found))
    if bench.stages is not None:
        print()
        print(stage_table(*bench.stages))
    planned_runs = 2 * (len(args.loads) if args.loads else len(offered_loads({Mode.BASE: 1.0})))
    return 0 if len(bench.loads) == planned_runs and overhead is not None else 1


if __name__ == "__main__":
    raise SystemExit(main())
