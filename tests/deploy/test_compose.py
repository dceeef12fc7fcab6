"""deploy/docker-compose.yml, checked offline: services and what they reference, Redis persistence,
GPU reservations, commands the lorafleet CLI accepts, and the Prometheus/Grafana files it mounts."""

from __future__ import annotations

import json
import re
import subprocess
from typing import Any

import pytest
import yaml

from gateway.metrics import GatewayMetrics
from tests.deploy.conftest import DEPLOY, REPO_ROOT, interpolate, parse_lorafleet_args
from worker.metrics import WorkerMetrics

COMPOSE_FILE = DEPLOY / "docker-compose.yml"
SAMPLE_ENV = {"LORAFLEET_MODEL": "llama3-8b=/models/Meta-Llama-3-8B"}


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load(interpolate(COMPOSE_FILE.read_text(), SAMPLE_ENV))


@pytest.fixture(scope="module")
def services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return compose["services"]


def gpu_reservations(service: dict[str, Any]) -> list[dict[str, Any]]:
    return service.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])


def test_the_worker_model_must_be_given():
    with pytest.raises(pytest.fail.Exception, match=r"LORAFLEET_MODEL\} is required"):
        interpolate(COMPOSE_FILE.read_text(), {})


def test_compose_has_the_fleet_and_its_monitoring(services: dict[str, dict[str, Any]]):
    assert {"redis", "gateway", "lb", "worker", "prometheus", "grafana", "mps", "worker-mps"} <= services.keys()
    assert services["mps"]["profiles"] == ["mps"]
    assert services["worker-mps"]["profiles"] == ["mps"]
    default = {name for name, service in services.items() if "profiles" not in service}
    assert {"redis", "gateway", "lb", "worker", "prometheus", "grafana"} == default


def test_redis_persists_append_only_and_never_evicts(services: dict[str, dict[str, Any]]):
    command = services["redis"]["command"]
    options = dict(zip(command[1::2], command[2::2], strict=True))
    assert options["--appendonly"] == "yes"
    assert options["--maxmemory-policy"] == "noeviction"
    assert options["--maxmemory"], "noeviction only refuses writes once maxmemory is set"
    assert any(volume.endswith(":/data") for volume in services["redis"]["volumes"])


def test_named_volumes_are_declared_and_bind_mounts_exist(compose: dict[str, Any]):
    declared = set(compose["volumes"])
    for name, service in compose["services"].items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith((".", "/")):
                if "models" in source or "adapters" in source:
                    continue  # the operator's model and adapter trees
                assert (DEPLOY / source).exists(), f"{name} mounts {source}, which is not in deploy/"
            else:
                assert source in declared, f"{name} uses volume {source!r}, not declared at the top level"


def test_depends_on_names_services(services: dict[str, dict[str, Any]]):
    for name, service in services.items():
        for dependency in service.get("depends_on", []):
            assert dependency in services, f"{name} depends on unknown service {dependency!r}"


def test_builds_point_at_dockerfiles_in_the_repo(services: dict[str, dict[str, Any]]):
    built = {name: service["build"] for name, service in services.items() if "build" in service}
    assert {"gateway", "worker", "worker-mps"} <= built.keys()
    for name, build in built.items():
        context = (DEPLOY / build["context"]).resolve()
        assert context == REPO_ROOT, f"{name} builds from {context}, not the repository root"
        assert (context / build["dockerfile"]).is_file(), f"{name}: {build['dockerfile']} is missing"


def test_gateway_scales_behind_the_load_balancer(services: dict[str, dict[str, Any]]):
    gateway = services["gateway"]
    assert "ports" not in gateway, "a fixed host port would stop `--scale gateway=N`"
    assert gateway["deploy"]["replicas"] >= 2
    assert gateway["deploy"]["mode"] == "replicated", "podman-compose starts one replica unless mode is given"
    assert gateway["environment"]["REDIS_URL"].startswith("redis://redis:")
    parse_lorafleet_args(gateway["command"])
    nginx_conf = (DEPLOY / "nginx" / "lorafleet.conf.template").read_text()
    assert "http://gateway:8000" in nginx_conf
    assert "proxy_read_timeout" in nginx_conf, "long-polls outlast nginx's default 60 s read timeout"


def test_nginx_resolves_through_the_container_engines_dns(services: dict[str, dict[str, Any]]):
    """127.0.0.11 is Docker's embedded DNS only; podman's is the network's aardvark-dns. The nginx image's
    entrypoint sources the mounted envsh, then renders the template with what it exported."""
    lb = services["lb"]
    envsh = "16-lorafleet-resolver.envsh"
    assert f"./nginx/{envsh}:/docker-entrypoint.d/{envsh}:ro" in lb["volumes"]
    assert (DEPLOY / "nginx" / envsh).stat().st_mode & 0o111, "the entrypoint ignores scripts it cannot execute"
    assert "./nginx/lorafleet.conf.template:/etc/nginx/templates/default.conf.template:ro" in lb["volumes"]
    nginx_conf = (DEPLOY / "nginx" / "lorafleet.conf.template").read_text()
    assert re.search(r"^resolver \$\{LORAFLEET_RESOLVER\} ", nginx_conf, re.MULTILINE)


@pytest.mark.parametrize(
    ("resolv_conf", "resolver"),
    [
        ("nameserver 127.0.0.11\noptions ndots:0\n", "127.0.0.11"),  # Docker
        ("search dns.podman\nnameserver 10.89.0.1\nnameserver 10.255.255.53\n", "10.89.0.1"),  # podman
        ("nameserver fd00::1\nnameserver 8.8.8.8\n", "[fd00::1]"),
    ],
)
def test_the_resolver_is_the_first_nameserver(tmp_path, resolv_conf: str, resolver: str):
    """Only the engine's own DNS knows the services: nginx would also ask the others, in turn."""
    (tmp_path / "resolv.conf").write_text(resolv_conf)
    script = (DEPLOY / "nginx" / "16-lorafleet-resolver.envsh").read_text()
    script = script.replace("/etc/resolv.conf", str(tmp_path / "resolv.conf"))
    result = subprocess.run(["sh", "-c", f'{script}\nprintf %s "$LORAFLEET_RESOLVER"'], capture_output=True, text=True)
    assert result.stdout == resolver, result.stderr


@pytest.mark.parametrize("name", ["worker", "worker-mps"])
def test_workers_reserve_a_gpu_and_run_a_valid_worker_command(services: dict[str, dict[str, Any]], name: str):
    worker = services[name]
    assert any("gpu" in device["capabilities"] for device in gpu_reservations(worker))
    shell, flag, script, *_ = worker["entrypoint"]
    assert (shell, flag) == ("sh", "-c")
    assert script.startswith('exec lorafleet worker --worker-id "$HOSTNAME" "$@"'), script
    parse_lorafleet_args(["worker", "--worker-id", "container-1", *worker["command"]])
    assert worker["healthcheck"]["test"] == ["CMD", "lorafleet-worker-health"]
    assert worker["environment"]["REDIS_URL"].startswith("redis://redis:")
    assert worker["stop_grace_period"] == "45s"


def test_mps_workers_share_the_daemons_pipe(services: dict[str, dict[str, Any]]):
    daemon, worker = services["mps"], services["worker-mps"]
    pipe = daemon["environment"]["CUDA_MPS_PIPE_DIRECTORY"]
    assert worker["environment"]["CUDA_MPS_PIPE_DIRECTORY"] == pipe
    shared_volume = next(v for v in daemon["volumes"] if pipe.startswith(v.split(":")[1]))
    assert shared_volume in worker["volumes"]
    assert daemon["ipc"] == worker["ipc"] == "host"
    assert "--gpu-memory-fraction" in worker["command"]  # MPS isolates no memory: a hard cap per process
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" in worker["environment"]


def test_prometheus_scrapes_every_gateway_replica():
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    (job,) = [job for job in config["scrape_configs"] if job["job_name"] == "lorafleet-gateway"]
    assert job["metrics_path"] == "/metrics"
    assert job["dns_sd_configs"] == [{"names": ["gateway"], "type": "A", "port": 8000, "refresh_interval": "15s"}]


def test_prometheus_scrapes_every_worker_on_its_metrics_port(services: dict[str, dict[str, Any]]):
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    (job,) = [job for job in config["scrape_configs"] if job["job_name"] == "lorafleet-worker"]
    assert job["metrics_path"] == "/metrics"
    (discovery,) = job["dns_sd_configs"]
    assert set(discovery["names"]) == {"worker", "worker-mps"}
    for name in discovery["names"]:
        worker = services[name]
        args = parse_lorafleet_args(["worker", "--worker-id", "container-1", *worker["command"]])
        assert (args.metrics_port, args.metrics_host) == (discovery["port"], "0.0.0.0")
        assert str(args.metrics_port) in worker["expose"]


def test_grafana_provisions_the_prometheus_datasource_and_the_dashboard(services: dict[str, dict[str, Any]]):
    provisioning = DEPLOY / "grafana" / "provisioning"
    (datasource,) = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())["datasources"]
    assert datasource["url"] == "http://prometheus:9090"
    (provider,) = yaml.safe_load((provisioning / "dashboards" / "lorafleet.yml").read_text())["providers"]
    mounted = dict(reversed(v.split(":")[:2]) for v in services["grafana"]["volumes"])
    assert (DEPLOY / mounted[provider["options"]["path"]] / "lorafleet.json").is_file()
    dashboard = json.loads((DEPLOY / "grafana" / "dashboards" / "lorafleet.json").read_text())
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] == datasource["uid"]


def exported_metric_names() -> set[str]:
    """Every series name a gateway or a worker exports (counters' _total, histograms' _bucket/_sum/_count, ...)."""
    gateway = GatewayMetrics()
    gateway.observe_request("GET", "/healthz", 200, 0.01)
    gateway.queue_depth.labels("demo", "interactive").set(1)
    gateway.queue_wait.labels("demo", "interactive").set(1)
    gateway.jobs_placed.labels("demo", "home").inc()
    worker = WorkerMetrics("cpu")
    worker.job_started("demo", "routed", "gpu")
    return {
        sample.name
        for registry in (gateway.registry, worker.registry)
        for family in registry.collect()
        for sample in family.samples
    }


def test_the_dashboard_queries_only_metrics_the_gateways_and_workers_export():
    dashboard = (DEPLOY / "grafana" / "dashboards" / "lorafleet.json").read_text()
    used = set(re.findall(r"\b(lorafleet_[a-z_]+)", dashboard))
    assert used, "the dashboard queries no lorafleet metric"
    assert used <= exported_metric_names(), used - exported_metric_names()


class _ComposeLoader(yaml.SafeLoader):
    """YAML with compose's merge tags: `!reset` drops what the file below set for that key."""


_ComposeLoader.add_constructor("!reset", lambda loader, node: _RESET)
_RESET = object()


def test_the_cpu_override_runs_the_worker_on_the_cpu_without_a_gpu_reservation():
    override = yaml.load(
        interpolate((DEPLOY / "docker-compose.cpu.yml").read_text(), {"LORAFLEET_MODEL": "smollm2=/models/smollm2"}),
        Loader=_ComposeLoader,
    )
    assert override["services"].keys() == {"worker"}, "CPU machines change only the worker"
    worker = override["services"]["worker"]
    assert worker["deploy"]["resources"] is _RESET, "the GPU reservation must go, or the engine asks for a GPU"
    args = parse_lorafleet_args(["worker", "--worker-id", "container-1", *worker["command"]])
    assert args.device == "cpu"
    assert (args.metrics_port, args.metrics_host) == (9200, "0.0.0.0"), "Prometheus scrapes the worker there"
