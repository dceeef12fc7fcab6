"""`lorafleet tenant create` and `lorafleet adapter register` against the real test Redis."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from cli.demo_adapters import DEMO_ADAPTERS
from cli.main import main
from cli.state import FleetState
from shared.adapter_registry import AdapterRecord, get_adapter
from shared.model_info import ModelInfo
from shared.model_registry import publish_model
from shared.tenants import authenticate
from tests.cli.conftest import DemoFiles

REPO_ROOT = Path(__file__).resolve().parents[2]
ACME = DEMO_ADAPTERS[0].path("demo")  # the random demo's rank-8 q/v adapter


def in_redis(redis_url: str, work):
    """Run `work(client)` on a fresh async client (the CLI runs its own event loops)."""

    async def run():
        async with aioredis.Redis.from_url(redis_url) as client:
            return await work(client)

    return asyncio.run(run())


def cli(*args: str) -> int:
    return main(list(args))


def register(
    redis_url: str, demo_files: DemoFiles, *extra: str, path: str = ACME, tenant: str = "acme", name: str = "support"
) -> int:
    return cli(
        *("adapter", "register", name, "--tenant", tenant, "--model", "demo", "--path", path),
        *("--adapter-root", str(demo_files.adapter_root), "--redis-url", redis_url, *extra),
    )


def test_tenant_create_json_prints_a_key_that_authenticates(redis_url: str, capsys: pytest.CaptureFixture) -> None:
    assert cli("tenant", "create", "acme", "--json", "--redis-url", redis_url) == 0

    printed = json.loads(capsys.readouterr().out)
    assert printed["tenant"] == "acme"
    tenant = in_redis(redis_url, lambda client: authenticate(client, printed["api_key"]))
    assert tenant.tenant_id == "acme"


def test_tenant_create_shows_the_key_once_in_words(redis_url: str, capsys: pytest.CaptureFixture) -> None:
    assert cli("tenant", "create", "acme", "--redis-url", redis_url) == 0
    out = capsys.readouterr().out
    assert "acme" in out and out.count("lf_") == 1


@pytest.mark.parametrize(
    ("name", "code"),
    [("acme", "conflict"), ("Not A Name", "invalid_request"), ("shared", "tenant_name_reserved")],
    ids=["existing", "bad-name", "reserved-name"],
)
def test_tenant_create_refusal_exits_2_with_the_code_and_no_traceback(
    redis_url: str, capsys: pytest.CaptureFixture, name: str, code: str
) -> None:
    cli("tenant", "create", "acme", "--redis-url", redis_url)
    capsys.readouterr()

    assert cli("tenant", "create", name, "--json", "--redis-url", redis_url) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith(f"error: {code}: ")
    assert "Traceback" not in captured.err


def test_adapter_register_json_prints_the_record_it_stored(
    redis_url: str, demo_files: DemoFiles, capsys: pytest.CaptureFixture
) -> None:
    cli("tenant", "create", "acme", "--redis-url", redis_url)
    capsys.readouterr()

    assert register(redis_url, demo_files, "--model-path", str(demo_files.model.path), "--json") == 0

    printed = json.loads(capsys.readouterr().out)
    stored = in_redis(redis_url, lambda client: get_adapter(client, "support"))
    assert printed == stored.to_dict()
    assert (printed["tenant"], printed["base_model"], printed["path"]) == ("acme", "demo", ACME)
    assert (printed["rank"], printed["target_modules"], printed["version"]) == (8, ["q_proj", "v_proj"], 1)


def test_adapter_register_takes_the_model_from_the_registry_workers_publish(
    redis_url: str, demo_files: DemoFiles, capsys: pytest.CaptureFixture
) -> None:
    cli("tenant", "create", "acme", "--redis-url", redis_url)
    info = ModelInfo.from_pretrained("demo", demo_files.model.path)
    in_redis(redis_url, lambda client: publish_model(client, info, b"{}"))
    capsys.readouterr()

    assert register(redis_url, demo_files, "--json") == 0
    assert AdapterRecord(**json.loads(capsys.readouterr().out)).base_model == "demo"


@pytest.mark.parametrize(
    ("setup", "extra", "code"),
    [
        ("outside-root", (), "adapter_path_outside_root"),
        ("others-path", (), "adapter_path_forbidden"),
        ("rank", ("--max-lora-rank", "4"), "adapter_rank_too_large"),
        ("no-model", (), "model_not_found"),
        ("no-tenant", (), "not_found"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_adapter_register_refusal_exits_2_with_the_code_and_registers_nothing(
    redis_url: str, demo_files: DemoFiles, capsys: pytest.CaptureFixture, setup: str, extra: tuple, code: str
) -> None:
    cli("tenant", "create", "acme", "--redis-url", redis_url)
    model_path = () if setup == "no-model" else ("--model-path", str(demo_files.model.path))
    path = {
        "outside-root": str(demo_files.model.path),  # a real directory, but not under the root
        "others-path": "globex/globex-legal",  # the demo's globex adapter, not acme's
    }.get(setup, ACME)
    tenant = "nobody" if setup == "no-tenant" else "acme"
    capsys.readouterr()

    assert register(redis_url, demo_files, *model_path, *extra, "--json", path=path, tenant=tenant) == 2

    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith(f"error: {code}: ")
    assert in_redis(redis_url, lambda client: get_adapter(client, "support")) is None


def test_admin_commands_find_redis_and_the_adapter_root_through_the_state_dir(
    redis_url: str, demo_files: DemoFiles, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    state_dir = tmp_path / "state"
    FleetState(redis_url, {"demo": demo_files.model.path}, demo_files.adapter_root, "http://127.0.0.1:1").save(
        state_dir
    )

    assert cli("tenant", "create", "acme", "--state-dir", str(state_dir)) == 0
    assert (
        cli(
            *("adapter", "register", "support", "--tenant", "acme", "--model", "demo", "--path", ACME),
            *("--model-path", str(demo_files.model.path), "--state-dir", str(state_dir)),
        )
        == 0
    )
    assert in_redis(redis_url, lambda client: get_adapter(client, "support")).path == ACME


def test_python_dash_m_cli_runs_the_command(redis_url: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "cli", "tenant", "create", "acme", "--json", "--redis-url", redis_url],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["tenant"] == "acme"
