"""What `lorafleet up` tells a person on stdout (logs go to stderr)."""

from __future__ import annotations

import json
import shlex
from collections.abc import Sequence
from pathlib import Path

from cli.demo import DemoTenant
from cli.state import ADMIN_KEY_FILE, DEMO_FILE, STATE_FILE
from shared.config import ModelSpec

_DEMO_PROMPT = "Once upon a time"


def _display(path: Path) -> str:
    """`path` relative to the working directory when it lies inside it: shorter to read and to paste."""
    return str(path.relative_to(Path.cwd())) if path.is_relative_to(Path.cwd()) else str(path)


def startup_banner(
    *,
    gateway_url: str,
    redis_url: str,
    embedded_redis: bool,
    state_dir: Path,
    models: Sequence[ModelSpec],
    workers: Sequence[str],
    worker_metrics: Sequence[str],
    demo_tenants: Sequence[DemoTenant],
) -> str:
    redis_where = f"embedded, data in {_display(state_dir / 'redis')}" if embedded_redis else "external"
    lines = [
        "lorafleet is starting",
        f"  gateway  {gateway_url}",
        f"  redis    {redis_url} ({redis_where})",
        *(f"  model    {spec.name}  ({_display(spec.path)})" for spec in models),
        f"  workers  {', '.join(workers)}",
        *(f"  metrics  {url}" for url in worker_metrics),
        f"  state    {_display(state_dir / STATE_FILE)}",
        f"  admin    key in {_display(state_dir / ADMIN_KEY_FILE)} (Bearer token for /v1/admin/*)",
    ]
    if demo_tenants:
        lines += ["", f"demo tenants (API keys are kept in {_display(state_dir / DEMO_FILE)}):"]
        width = max(len(t.tenant) for t in demo_tenants)
        lines += [f"  {t.tenant:<{width}}  {t.api_key}  adapter {', '.join(t.adapters)}" for t in demo_tenants]
        lines += ["", "try:", *_examples(gateway_url, state_dir, models[0].name, demo_tenants[0])]
    return "\n".join(lines)


def _examples(gateway_url: str, state_dir: Path, model: str, tenant: DemoTenant) -> list[str]:
    body = json.dumps({"model": model, "adapter": tenant.adapters[0], "prompt": _DEMO_PROMPT, "max_tokens": 32})
    auth = shlex.quote(f"Authorization: Bearer {tenant.api_key}")
    submit = shlex.join(
        [
            *("lorafleet", "submit", "--state-dir", _display(state_dir), "--tenant", tenant.tenant),
            *("--model", model, "--adapter", tenant.adapters[0], _DEMO_PROMPT),
        ]
    )
    return [
        f"  curl -s {gateway_url}/v1/jobs -H {auth} -H 'Content-Type: application/json' -d {shlex.quote(body)}",
        f"  curl -s '{gateway_url}/v1/jobs/<id>?wait=30' -H {auth}",
        f"  {submit}",
    ]
