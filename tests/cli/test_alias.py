"""`lorafleet alias set / list / delete` against the real test Redis: a canary's weights set, changed
and listed, a refusal exits 2 with its code, and a deleted alias is gone."""

from __future__ import annotations

import json

import pytest

from shared.adapter_aliases import get_alias
from tests.cli.conftest import DemoFiles
from tests.cli.test_admin import cli, in_redis, register


@pytest.fixture
def two_versions(redis_url: str, demo_files: DemoFiles) -> None:
    """acme's adapter `support` and, at the same path, `support-v3`."""
    cli("tenant", "create", "acme", "--redis-url", redis_url)
    model_path = ("--model-path", str(demo_files.model.path))
    assert register(redis_url, demo_files, *model_path) == 0
    assert register(redis_url, demo_files, *model_path, name="support-v3") == 0


def alias(redis_url: str, *args: str) -> int:
    return cli("alias", *args, "--redis-url", redis_url)


def test_set_change_list_and_delete_an_alias(redis_url: str, two_versions, capsys: pytest.CaptureFixture) -> None:
    capsys.readouterr()
    set_args = ("set", "bot", "--tenant", "acme", "--adapter", "support=95", "--adapter", "support-v3=5", "--json")
    assert alias(redis_url, *set_args) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["versions"] == [{"adapter": "support", "weight": 95}, {"adapter": "support-v3", "weight": 5}]

    assert (
        alias(redis_url, "set", "bot", "--tenant", "acme", "--adapter", "support=0", "--adapter", "support-v3=1") == 0
    )
    stored = in_redis(redis_url, lambda client: get_alias(client, "bot"))
    assert [(v.adapter, v.weight) for v in stored.versions] == [("support", 0), ("support-v3", 1)]
    assert alias(redis_url, "list") == 0
    assert "bot (tenant acme, model demo): support 0%, support-v3 100%" in capsys.readouterr().out

    assert alias(redis_url, "delete", "bot") == 0
    assert in_redis(redis_url, lambda client: get_alias(client, "bot")) is None


@pytest.mark.parametrize(
    ("args", "code"),
    [
        (("--tenant", "acme", "--adapter", "support=0"), "invalid_request"),
        (("--tenant", "acme", "--adapter", "nope=1"), "adapter_not_found"),
        (("--tenant", "nobody", "--adapter", "support=1"), "not_found"),
    ],
    ids=["zero-weights", "unknown-adapter", "unknown-tenant"],
)
def test_a_refused_alias_exits_2_with_the_code(
    redis_url: str, two_versions, capsys: pytest.CaptureFixture, args: tuple, code: str
) -> None:
    capsys.readouterr()
    assert alias(redis_url, "set", "bot", *args) == 2
    assert capsys.readouterr().err.startswith(f"error: {code}: ")
    assert in_redis(redis_url, lambda client: get_alias(client, "bot")) is None
