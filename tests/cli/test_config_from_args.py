"""Configurations built from flags: the values land where they belong, and every mistake names its flag."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cli import config_from_args as cfa
from cli.main import build_parser, main
from cli.state import DEMO_FILE, FleetState
from shared.adapter_format import CONFIG_FILE
from shared.tenants import hash_admin_key
from tests.cli.conftest import DemoFiles

REDIS = "redis://127.0.0.1:7777/0"
PRELOAD_WITHOUT_LORA = ("--max-loras", "0", "--preload-adapters", "x")


def parse(*args: str):
    return build_parser().parse_args(list(args))


@pytest.fixture
def cpu_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cfa, "visible_gpus", lambda: [])


@pytest.fixture
def running_up(tmp_path: Path, demo_files: DemoFiles) -> Path:
    """A state dir as a running `lorafleet up` leaves it."""
    state_dir = tmp_path / "state"
    FleetState(REDIS, {"demo": demo_files.model.path}, demo_files.adapter_root, "http://127.0.0.1:8123").save(state_dir)
    (state_dir / DEMO_FILE).write_text(json.dumps({"tenants": [{"tenant": "acme", "api_key": "lf_k", "adapters": []}]}))
    return state_dir


@pytest.mark.parametrize(
    ("flags", "flag"),
    [
        (("--max-num-seqs", "0"), "--max-num-seqs"),
        (("--max-num-batched-tokens", "lots"), "--max-num-batched-tokens"),
        (("--gpu-memory-utilization", "1.5"), "--gpu-memory-utilization"),
        (("--num-kv-blocks", "-3"), "--num-kv-blocks"),
        (("--dtype", "float8"), "--dtype"),
        (("--device", "tpu"), "--device"),
        (("--model", "no-equals-sign"), "--model"),
        (("--model", "demo=/no/such/dir"), "--model"),
        (("--preload-adapters", "good,bad:name"), "--preload-adapters"),
        (("--max-loras", "-1"), "--max-loras"),
    ],
)
def test_a_malformed_worker_flag_exits_2_naming_it(capsys: pytest.CaptureFixture, flags: tuple, flag: str) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["worker", "--redis-url", REDIS, *flags])
    assert exited.value.code == 2
    assert f"argument {flag}: " in capsys.readouterr().err


def test_a_malformed_port_exits_2_naming_it(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        main(["up", "--port", "70000"])
    assert "argument --port: must be a TCP port" in capsys.readouterr().err


def test_worker_config_carries_every_flag(demo_files: DemoFiles, cpu_only: None) -> None:
    args = parse(
        *("worker", "--redis-url", REDIS, "--model", f"demo={demo_files.model.path}"),
        *("--adapter-root", str(demo_files.adapter_root), "--device", "cpu", "--dtype", "bfloat16"),
        *("--max-num-seqs", "3", "--max-num-batched-tokens", "99", "--max-loras", "2", "--max-lora-rank", "16"),
        *("--num-kv-blocks", "40", "--gpu-memory-utilization", "0.5", "--worker-id", "w1"),
        *("--adapter-host-cache-gb", "1.5", "--adapter-eviction", "lfu", "--preload-adapters", "a,b.v2,a"),
        *("--max-grouping-overtakes", "0", "--no-int4-decode-copy"),
    )
    config = cfa.worker_config(args)
    assert (config.redis_url, config.worker_id, config.adapter_root) == (REDIS, "w1", demo_files.adapter_root)
    assert [(m.name, m.path) for m in config.models] == [("demo", demo_files.model.path)]
    engine = config.engine
    assert (engine.device, engine.dtype, engine.max_num_seqs, engine.max_num_batched_tokens) == (
        "cpu",
        "bfloat16",
        3,
        99,
    )
    assert (engine.max_loras, engine.max_lora_rank, engine.num_kv_blocks, engine.gpu_memory_utilization) == (
        2,
        16,
        40,
        0.5,
    )
    assert (engine.adapter_host_cache_gb, engine.adapter_eviction, engine.max_grouping_overtakes) == (1.5, "lfu", 0)
    assert config.preload_adapters == ("a", "b.v2")


def test_worker_model_switching_and_gpu_share_flags(demo_files: DemoFiles, cpu_only: None) -> None:
    base = ("worker", "--redis-url", REDIS, "--model", f"demo={demo_files.model.path}", "--device", "cpu")
    base += ("--adapter-root", str(demo_files.adapter_root))
    config = cfa.worker_config(
        parse(*base, "--max-resident-models", "1", "--cpu-model-cache-gb", "1.5", "--switch-grace", "4")
    )
    assert (config.max_resident_models, config.cpu_model_cache_bytes, config.switch_grace_s) == (1, 3 << 29, 4.0)
    assert config.engine.gpu_memory_fraction is None
    assert cfa.worker_config(parse(*base, "--gpu-memory-fraction", "0.4")).engine.gpu_memory_fraction == 0.4
    defaults = cfa.worker_config(parse(*base))
    assert (defaults.max_resident_models, defaults.cpu_model_cache_bytes, defaults.preload_adapters) == (None, 0, ())
    assert defaults.engine.int4_decode_copy  # affine 4-bit weights keep their tensor-core copy unless told


def test_adapter_grouping_overtakes_a_quarter_of_the_batch_unless_told(demo_files: DemoFiles, cpu_only: None) -> None:
    base = ("worker", "--redis-url", REDIS, "--model", f"demo={demo_files.model.path}", "--device", "cpu")
    base += ("--adapter-root", str(demo_files.adapter_root), "--max-num-seqs", "128")
    assert cfa.worker_config(parse(*base)).engine.grouping_overtakes == 32
    assert cfa.worker_config(parse(*base, "--max-grouping-overtakes", "0")).engine.grouping_overtakes == 0
    with pytest.raises(SystemExit):
        parse(*base, "--max-grouping-overtakes", "-1")


def test_max_loras_0_starts_a_worker_without_lora(demo_files: DemoFiles, cpu_only: None) -> None:
    base = ("worker", "--redis-url", REDIS, "--model", f"demo={demo_files.model.path}", "--device", "cpu")
    config = cfa.worker_config(parse(*base, "--adapter-root", str(demo_files.adapter_root), "--max-loras", "0"))
    assert config.engine.max_loras == 0 and not config.engine.lora_enabled


def test_worker_joins_a_running_up_through_its_state_dir(running_up: Path, demo_files: DemoFiles, cpu_only) -> None:
    config = cfa.worker_config(parse("worker", "--state-dir", str(running_up)))
    assert config.redis_url == REDIS
    assert [(m.name, m.path) for m in config.models] == [("demo", demo_files.model.path)]
    assert config.adapter_root == demo_files.adapter_root
    assert config.engine.device == "cpu"  # auto, with no GPU


@pytest.mark.parametrize(
    ("flags", "flag"),
    [
        (lambda model, root: (), "--model"),
        (lambda model, root: ("--model", model, "--model", model), "--model"),
        (lambda model, root: ("--model", model), "--adapter-root"),
        (
            lambda model, root: ("--model", model, "--adapter-root", f"{root}/acme/acme-support/{CONFIG_FILE}"),
            "--adapter-root",
        ),
        (lambda model, root: ("--model", model, "--adapter-root", root, "--device", "cuda"), "--device"),
        (lambda model, root: ("--model", model, "--adapter-root", root, *PRELOAD_WITHOUT_LORA), "--preload-adapters"),
    ],
    ids=["no-model", "model-twice", "no-adapter-root", "adapter-root-not-a-dir", "cuda-without-gpu", "preload-no-lora"],
)
def test_a_missing_or_contradictory_worker_setting_names_its_flag(
    demo_files: DemoFiles, cpu_only: None, flags, flag: str
) -> None:
    given = flags(f"demo={demo_files.model.path}", str(demo_files.adapter_root))
    with pytest.raises(cfa.ConfigError) as refused:
        cfa.worker_config(parse("worker", "--redis-url", REDIS, *given))
    assert refused.value.flag == flag


def test_without_a_redis_url_anywhere_the_error_names_the_flag(capsys: pytest.CaptureFixture) -> None:
    assert main(["tenant", "create", "acme"]) == 2
    assert capsys.readouterr().err.startswith("error: --redis-url: ")


def test_a_state_dir_without_a_running_up_is_reported_not_raised(tmp_path: Path, capsys) -> None:
    assert main(["tenant", "create", "acme", "--state-dir", str(tmp_path / "none")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "lorafleet.json does not exist" in err and "Traceback" not in err


def test_redis_url_flag_beats_state_dir_which_beats_the_environment(
    running_up: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("REDIS_URL", "redis://from-env:1/0")
    assert cfa.redis_url(parse("tenant", "create", "x", "--redis-url", "redis://flag:1/0")) == "redis://flag:1/0"
    assert cfa.redis_url(parse("tenant", "create", "x", "--state-dir", str(running_up))) == REDIS
    assert cfa.redis_url(parse("tenant", "create", "x")) == "redis://from-env:1/0"


def test_gateway_config_from_flags(running_up: Path) -> None:
    config = cfa.gateway_config(parse("gateway", "--state-dir", str(running_up), "--host", "0.0.0.0", "--port", "9001"))
    assert (config.redis_url, config.host, config.port) == (REDIS, "0.0.0.0", 9001)


def test_gateway_batch_limits_from_flags(running_up: Path) -> None:
    flags = ("--max-file-bytes", "1024", "--max-file-lines", "10", "--batch-lines-in-flight", "7")
    config = cfa.gateway_config(parse("gateway", "--state-dir", str(running_up), *flags))
    batches = config.batches
    assert (batches.max_file_bytes, batches.max_file_lines, batches.lines_in_flight) == (1024, 10, 7)


def test_up_defaults_to_the_demo_in_dot_lorafleet_with_an_embedded_redis(tmp_path: Path, cpu_only: None) -> None:
    config = cfa.up_config(parse("up"))
    assert config.demo and config.redis_url is None and config.gpus == ()
    assert config.state_dir == tmp_path / ".lorafleet"
    assert config.adapter_root == tmp_path / ".lorafleet" / "adapters"
    assert (config.host, config.port) == ("127.0.0.1", 8000)
    assert config.worker_metrics_ports(2) == [cfa.DEFAULT_WORKER_METRICS_PORT, cfa.DEFAULT_WORKER_METRICS_PORT + 1]
    assert cfa.up_config(parse("up", "--worker-metrics-port", "0")).worker_metrics_ports(2) == []


def test_up_starts_one_worker_per_visible_gpu_unless_told_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cfa, "visible_gpus", lambda: ["0", "1"])
    assert cfa.up_config(parse("up")).gpus == ("0", "1")
    assert cfa.up_config(parse("up", "--device", "cpu")).gpus == ()


def test_up_on_cuda_without_a_gpu_names_the_device_flag(cpu_only: None) -> None:
    with pytest.raises(cfa.ConfigError) as refused:
        cfa.up_config(parse("up", "--device", "cuda"))
    assert refused.value.flag == "--device"


def test_submit_takes_url_and_key_from_a_demo_state_dir(running_up: Path) -> None:
    target = cfa.submit_target(
        parse("submit", "hi", "--model", "demo", "--state-dir", str(running_up), "--tenant", "acme")
    )
    assert (target.gateway_url, target.api_key) == ("http://127.0.0.1:8123", "lf_k")


@pytest.mark.parametrize(
    ("flags", "flag"),
    [
        (("--tenant", "nobody"), "--tenant"),
        (("--tenant", "acme", "--api-key", "lf_x"), "--tenant"),
        (("--url", "http://h:1"), "--api-key"),
    ],
)
def test_submit_target_errors_name_the_flag(running_up: Path, flags: tuple, flag: str) -> None:
    with pytest.raises(cfa.ConfigError) as refused:
        cfa.submit_target(parse("submit", "hi", "--model", "demo", "--state-dir", str(running_up), *flags))
    assert refused.value.flag == flag


def test_gateway_takes_the_admin_key_from_a_file_and_stores_only_its_hash(tmp_path, monkeypatch):
    monkeypatch.delenv("LORAFLEET_ADMIN_KEY", raising=False)
    key_file = tmp_path / "admin_key"
    key_file.write_text("lfadmin_secret\n")
    args = build_parser().parse_args(
        ["gateway", "--redis-url", "redis://x:1/0", "--admin-key-file", str(key_file), "--requests-per-min", "5"]
    )
    config = cfa.gateway_config(args)
    assert config.admin_key_sha256 == hash_admin_key("lfadmin_secret")
    assert config.tenant_limits.requests_per_min == 5


def test_gateway_without_an_admin_key_leaves_the_admin_api_off(monkeypatch):
    monkeypatch.delenv("LORAFLEET_ADMIN_KEY", raising=False)
    config = cfa.gateway_config(build_parser().parse_args(["gateway", "--redis-url", "redis://x:1/0"]))
    assert config.admin_key_sha256 is None


def test_unreadable_admin_key_file_names_the_flag(tmp_path):
    args = build_parser().parse_args(
        ["gateway", "--redis-url", "redis://x:1/0", "--admin-key-file", str(tmp_path / "missing")]
    )
    with pytest.raises(cfa.ConfigError) as info:
        cfa.gateway_config(args)
    assert info.value.flag == "--admin-key-file"


def test_gateway_webhooks_are_off_by_default_and_need_a_secret_once_a_host_is_allowed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(cfa.WEBHOOK_SECRET_ENV, raising=False)
    assert not cfa.gateway_config(parse("gateway", "--redis-url", REDIS)).webhooks.enabled
    with pytest.raises(cfa.ConfigError) as refused:
        cfa.gateway_config(parse("gateway", "--redis-url", REDIS, "--webhook-allow-host", "hooks.example"))
    assert refused.value.flag == "--webhook-secret-file"
    secret = tmp_path / "webhook_secret"
    secret.write_text("s3cret\n")
    flags = ["--webhook-allow-host", "a.example", "--webhook-allow-host", "*.b.example", "--webhook-secret-file"]
    webhooks = cfa.gateway_config(parse("gateway", "--redis-url", REDIS, *flags, str(secret))).webhooks
    assert (webhooks.allow_hosts, webhooks.secret, webhooks.allow_http) == (
        ("a.example", "*.b.example"),
        "s3cret",
        False,
    )
    assert webhooks.enabled


def test_worker_kernel_plans_live_in_the_state_dir_unless_given(demo_files: DemoFiles, cpu_only, tmp_path) -> None:
    base = ("worker", "--redis-url", REDIS, "--model", f"demo={demo_files.model.path}", "--device", "cpu")
    base += ("--adapter-root", str(demo_files.adapter_root))
    default = cfa.worker_config(parse(*base))
    assert default.kernel_plans_dir == tmp_path / ".lorafleet" / "kernel-plans"
    assert default.engine.kernel_tune_budget_s == 120.0
    config = cfa.worker_config(parse(*base, "--kernel-plans-dir", "plans", "--kernel-tune-budget-s", "0"))
    assert (config.kernel_plans_dir, config.engine.kernel_tune_budget_s) == (tmp_path / "plans", 0.0)


def test_tune_writes_the_cache_of_a_state_dir_or_the_packaged_table(demo_files: DemoFiles, tmp_path: Path) -> None:
    model = ("tune", "--model", f"demo={demo_files.model.path}")
    config = cfa.tune_config(parse(*model, "--state-dir", "state", "--tokens", "64", "1", "64", "--budget-s", "30"))
    assert (config.plans_dir, config.buckets, config.budget_s) == (tmp_path / "state" / "kernel-plans", (1, 64), 30.0)
    assert (config.model.name, config.max_lora_rank) == ("demo", 64)
    assert cfa.tune_config(parse(*model, "--packaged")).plans_dir is None
    assert cfa.tune_config(parse(*model)).buckets is None
