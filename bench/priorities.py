"""Interactive traffic beside a batch (issue #24): does batch work fill the GPU without slowing
interactive requests?

    python -m bench.priorities [--preset llama3-8b] [--batch-lines 20000] [--out DIR] [--workdir DIR]
                               [--budget-s 900]

1. Assets and the stack as bench.e2e builds them (the preset's model, its adapters, Redis, the
   worker, the gateways), then a warm-up.
2. Saturation: a closed loop of Zipf adapter traffic keeping max_num_seqs requests in flight; the
   output tok/s of its second half is the worker's saturation.
3. Alone: open-loop Poisson Zipf traffic (interactive jobs) at 50% of saturation.
4. With a batch: a batch of --batch-lines completion lines (Zipf over tenant0's adapters, the same
   prompt and output lengths) is uploaded and started; once it runs, the same interactive plan again.
   Total output tok/s is the worker's own token counter over the run (interactive + batch).
5. The batch runs to its end (as the budget allows): lines/s, and every line in the output or error
   file exactly once.

Targets (printed beside the figures): interactive p99 TTFT with the batch <= 1.2x without it; total
output tok/s with the batch >= 0.9x saturation; the batch complete with every line exactly once.
Written to --out: priorities.jsonl (one line per run, then the targets).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import resource
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

import redis

from bench.e2e.__main__ import _WARMUP_WAIT_S, Bench, Budget
from bench.e2e.assets import tenant_name
from bench.e2e.client import LoadClient
from bench.e2e.presets import PRESETS
from bench.e2e.stack import Stack, start_stack
from bench.e2e.summary import RunSummary, summarize, window_tok_s
from bench.e2e.traffic import Mode, RequestSource, TrafficShape, poisson_plan
from bench.e2e.worker_metrics import difference
from cli.batch import multipart_body
from cli.config_from_args import SubmitTarget
from cli.submit import call_gateway, send
from shared import keys
from shared.schema import Priority

INTERACTIVE_FRACTION = 0.5  # of saturation
TTFT_P99_RATIO_TARGET = 1.2
SATURATION_RATIO_TARGET = 0.9
_HTTP_TIMEOUT_S = 120.0
_BATCH_POLL_S = 1.0
_TERMINAL = ("completed", "failed", "expired", "cancelled")


@dataclass(frozen=True, slots=True)
class Target:
    name: str
    value: float
    target: str
    met: bool | None  # None: not measured


@dataclass(slots=True)
class BatchOutcome:
    lines: int
    status: str = "unfinished"
    seconds: float = math.nan  # creation to its end (or to the last look, if the budget ended first)
    completed: int = 0
    failed: int = 0
    exactly_once: bool | None = None  # every custom_id in the output or error file once; None: not read

    @property
    def lines_per_s(self) -> float:
        return (self.completed + self.failed) / self.seconds if self.seconds > 0 else math.nan


class PriorityBench:
    def __init__(self, bench: Bench, batch_lines: int) -> None:
        self.bench = bench
        self.preset = bench.preset
        self.batch_lines = batch_lines
        self.rows: list[RunSummary] = []
        self.totals_tok_s: dict[str, float] = {}  # run → the worker's output tok/s over it
        self.saturation_tok_s = math.nan
        self.batch = BatchOutcome(batch_lines)

    def run(self) -> None:
        bench, p = self.bench, self.preset
        bench.write_assets()
        log_dir = bench.workdir / "logs"
        log_dir.mkdir(exist_ok=True)
        stack = start_stack(bench.workdir, log_dir, bench.model, bench.adapter_root, bench.adapters, p.num_tenants,
                            p.engine, p.gateways)  # fmt: skip
        try:
            client = LoadClient(stack.gateway_urls, stack.api_keys, bench.model.name)
            warmup = RequestSource(bench.shape(Mode.ZIPF), seed=1)
            burst = [warmup.draw(i, 0.0, adapter) for i, adapter in enumerate(bench.adapters)]
            burst += [warmup.draw(len(burst) + i, 0.0) for i in range(p.warmup_requests)]
            asyncio.run(client.open_loop(burst, _WARMUP_WAIT_S, stack.probe))
            self.saturate(client, stack)
            rate = INTERACTIVE_FRACTION * self.saturation_tok_s / p.output_tokens
            plan = poisson_plan(bench.shape(Mode.ZIPF), rate, p.run_s, seed=100)
            self.interactive_run("alone", client, stack, plan, rate)
            target = SubmitTarget(stack.gateway_urls[0], stack.api_keys[tenant_name(0)])
            batch_id, started = self.start_batch(target, stack)
            self.interactive_run("with-batch", client, stack, plan, rate)
            self.finish_batch(target, batch_id, started)
        finally:
            stack.stop()

    def saturate(self, client: LoadClient, stack: Stack) -> None:
        p = self.preset
        source = RequestSource(self.bench.shape(Mode.ZIPF), seed=10)
        record = asyncio.run(client.closed_loop(source.endless(), p.engine.max_num_seqs, p.calibration_s, stack.probe))
        self.saturation_tok_s = window_tok_s(record.token_times_s, p.calibration_s / 2, p.calibration_s)
        row = summarize("saturation", Mode.ZIPF, 0.0, record.samples, probes=record.probes)
        self.rows.append(dataclasses.replace(row, output_tok_s=self.saturation_tok_s))
        print(f"saturation: {self.saturation_tok_s:.0f} tok/s", flush=True)

    def interactive_run(self, name: str, client: LoadClient, stack: Stack, plan: list, rate: float) -> None:
        before, started = stack.worker_metrics(), time.monotonic()
        record = asyncio.run(client.open_loop(plan, self.preset.drain_s, stack.probe))
        worker = difference(before, stack.worker_metrics())
        self.totals_tok_s[name] = worker.generated_tokens / (time.monotonic() - started)
        row = summarize(name, Mode.ZIPF, rate, record.samples, probes=record.probes, worker=worker)
        self.rows.append(row)
        print(f"{name}: {row.requests} interactive requests, {row.failed} failed, TTFT p50/p99 "
              f"{row.ttft_p50_ms:.0f}/{row.ttft_p99_ms:.0f} ms, interactive {row.output_tok_s:.0f} tok/s, "
              f"total {self.totals_tok_s[name]:.0f} tok/s, GPU {row.gpu_util_pct:.0f}%", flush=True)  # fmt: skip

    def start_batch(self, target: SubmitTarget, stack: Stack) -> tuple[str, float]:
        """Upload and create the batch; return once its first lines are queued (the batch runs)."""
        shape = self.bench.shape(Mode.ZIPF)
        own = [adapter for adapter in self.bench.adapters if adapter.tenant == tenant_name(0)]
        source = RequestSource(TrafficShape(Mode.ZIPF, own, 1, shape.zipf_alpha, shape.vocab_size,
                                            shape.prompt_tokens, shape.output_tokens), seed=7)  # fmt: skip
        model = self.bench.model.name
        lines = []
        for index in range(self.batch_lines):
            request = source.draw(index, 0.0)
            body = {"model": f"{model}:{request.adapter}", "prompt": request.prompt_text,
                    "max_tokens": request.max_tokens, "temperature": 0.0, "ignore_eos": True}  # fmt: skip
            lines.append({"custom_id": f"line-{index}", "method": "POST", "url": "/v1/completions", "body": body})
        content = "".join(json.dumps(line) + "\n" for line in lines).encode()
        upload, content_type = multipart_body("batch", "bench.jsonl", content)
        started = time.monotonic()
        uploaded = json.loads(send(target, "POST", "/v1/files", _HTTP_TIMEOUT_S, upload, content_type))
        request = {"input_file_id": uploaded["id"], "endpoint": "/v1/completions", "completion_window": "24h"}
        batch = call_gateway(target, "POST", "/v1/batches", _HTTP_TIMEOUT_S, request)
        while batch["status"] == "validating" or (batch["status"] == "in_progress" and not self._batch_queue(stack)):
            time.sleep(0.1)
            batch = call_gateway(target, "GET", f"/v1/batches/{batch['id']}", _HTTP_TIMEOUT_S)
        print(f"batch {batch['id']}: {self.batch_lines} lines, {batch['status']}", flush=True)
        return batch["id"], started

    def _batch_queue(self, stack: Stack) -> int:
        with redis.Redis.from_url(stack.redis_url) as client:
            return int(client.xlen(keys.queue(self.bench.model.name, Priority.BATCH)))

    def finish_batch(self, target: SubmitTarget, batch_id: str, started: float) -> None:
        batch = call_gateway(target, "GET", f"/v1/batches/{batch_id}", _HTTP_TIMEOUT_S)
        while batch["status"] not in _TERMINAL and self.bench.budget.left() > 30:
            time.sleep(_BATCH_POLL_S)
            batch = call_gateway(target, "GET", f"/v1/batches/{batch_id}", _HTTP_TIMEOUT_S)
        outcome = self.batch
        outcome.status, outcome.seconds = batch["status"], time.monotonic() - started
        outcome.completed, outcome.failed = batch["request_counts"]["completed"], batch["request_counts"]["failed"]
        if batch["status"] not in _TERMINAL:  # lines/s is still measured, over the lines done so far
            print(f"batch {batch_id}: still {batch['status']} when the budget ran out", flush=True)
            return
        custom_ids: list[str] = []
        for file_id in (batch["output_file_id"], batch["error_file_id"]):
            if file_id is not None:
                content = send(target, "GET", f"/v1/files/{file_id}/content", _HTTP_TIMEOUT_S, None, "application/json")
                custom_ids += [json.loads(line)["custom_id"] for line in content.splitlines()]
        expected = {f"line-{index}" for index in range(self.batch_lines)}
        outcome.exactly_once = len(custom_ids) == len(expected) and set(custom_ids) == expected
        print(f"batch {batch_id}: {outcome.status} in {outcome.seconds:.0f} s, {outcome.lines_per_s:.1f} lines/s, "
              f"{outcome.failed} failed, every line exactly once: {outcome.exactly_once}", flush=True)  # fmt: skip

    def targets(self) -> list[Target]:
        alone = next((r for r in self.rows if r.phase == "alone"), None)
        mixed = next((r for r in self.rows if r.phase == "with-batch"), None)
        found = []
        if alone is not None and mixed is not None:
            ratio = mixed.ttft_p99_ms / alone.ttft_p99_ms if alone.ttft_p99_ms > 0 else math.nan
            found.append(Target("interactive p99 TTFT, with / without the batch", ratio,
                                f"<= {TTFT_P99_RATIO_TARGET}", ratio <= TTFT_P99_RATIO_TARGET))  # fmt: skip
        if "with-batch" in self.totals_tok_s and self.saturation_tok_s > 0:
            ratio = self.totals_tok_s["with-batch"] / self.saturation_tok_s
            found.append(Target("total output tok/s with the batch / saturation", ratio,
                                f">= {SATURATION_RATIO_TARGET}", ratio >= SATURATION_RATIO_TARGET))  # fmt: skip
        found.append(Target("batch complete, every line once", float(bool(self.batch.exactly_once)), "1",
                            None if self.batch.exactly_once is None else
                            self.batch.exactly_once and self.batch.status == "completed"))  # fmt: skip
        return found

    def write(self, out: Path, found: list[Target]) -> None:
        out.mkdir(parents=True, exist_ok=True)
        with (out / "priorities.jsonl").open("w") as f:
            meta = {"kind": "meta", "device": self.bench.notes["device"], "preset": self.preset.name,
                    "saturation_tok_s": self.saturation_tok_s, "batch": {**asdict(self.batch),
                    "lines_per_s": self.batch.lines_per_s}}  # fmt: skip
            f.write(json.dumps(meta) + "\n")
            for row in self.rows:
                total = self.totals_tok_s.get(row.phase)
                f.write(json.dumps({"kind": "run", **asdict(row), "total_output_tok_s": total}) + "\n")
            for target in found:
                f.write(json.dumps({"kind": "target", **asdict(target)}) + "\n")


def table(bench: PriorityBench, found: list[Target]) -> str:
    lines = ["| run | interactive req | TTFT p50 ms | TTFT p99 ms | interactive tok/s | total tok/s | GPU % |",
             "| --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for row in bench.rows:
        total = bench.totals_tok_s.get(row.phase, row.output_tok_s)
        lines.append(f"| {row.phase} | {row.requests} | {row.ttft_p50_ms:.0f} | {row.ttft_p99_ms:.0f} "
                     f"| {row.output_tok_s:.0f} | {total:.0f} | {row.gpu_util_pct:.0f} |")  # fmt: skip
    outcome = bench.batch
    lines += ["", f"batch: {outcome.lines} lines, {outcome.status}, {outcome.lines_per_s:.1f} lines/s", "",
              "| target | value | wanted | met |", "| --- | --- | --- | --- |"]  # fmt: skip
    lines += [f"| {t.name} | {t.value:.2f} | {t.target} | {t.met} |" for t in found]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="llama3-8b")
    parser.add_argument("--batch-lines", type=int, default=20_000)
    parser.add_argument("--out", type=Path, default=Path("priorities-out"))
    parser.add_argument("--workdir", type=Path, help="model, adapters, Redis data, logs (default: a new temp dir)")
    parser.add_argument("--budget-s", type=float, default=900.0, help="wall-clock budget (default: %(default)s)")
    args = parser.parse_args(argv)
    resource.setrlimit(resource.RLIMIT_NOFILE, (resource.getrlimit(resource.RLIMIT_NOFILE)[1],) * 2)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="lorafleet-priorities-"))
    workdir.mkdir(parents=True, exist_ok=True)
    bench = PriorityBench(Bench(PRESETS[args.preset], workdir, args.out, Budget(args.budget_s)), args.batch_lines)
    try:
        bench.run()
    except Exception:  # report what was measured before the failure, then fail
        traceback.print_exc()
    found = bench.targets()
    bench.write(args.out, found)
    print(table(bench, found))
    measured = {row.phase for row in bench.rows} >= {"alone", "with-batch"}
    return 0 if measured and bench.batch.status in _TERMINAL else 1


if __name__ == "__main__":
    raise SystemExit(main())
