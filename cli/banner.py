"""What `lorafleet up` tells a person on stdout (logs go to stderr)."""

from __future__ import annotations

import json
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

from cli.demo import DemoTenant
from cli.demo_styles import DEMO_COMPLETION, DEMO_QUESTION
from cli.state import ADMIN_KEY_FILE, DEMO_FILE, STATE_FILE
from shared.config import ModelSpec


def _display(path: Path) -> str:
    """`path` relative to the working directory when it lies inside it: shorter to read and to paste."""
    return str(path.relative_to(Path.cwd())) if path.is_relative_to(Path.cwd()) else str(path)


def lorafleet_command() -> str:
    """How to run `lorafleet` from here: the script beside this interpreter (`make up` does not put
    .venv/bin on PATH), else the bare name."""
    script = Path(sys.executable).parent / "lorafleet"
    return _display(script) if script.is_file() else "lorafleet"


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
    adapter = tenant.adapters[0]
    messages = [{"role": "user", "content": DEMO_QUESTION}]
    chat = json.dumps({"model": f"{model}:{adapter}", "messages": messages, "max_tokens": 48, "temperature": 0})
    prompt, max_tokens = DEMO_COMPLETION
    job = json.dumps({"model": model, "adapter": adapter, "prompt": prompt, "max_tokens": max_tokens})
    auth = shlex.quote(f"Authorization: Bearer {tenant.api_key}")
    json_type = "-H 'Content-Type: application/json'"
    submit = shlex.join(
        [
            *(lorafleet_command(), "submit", "--state-dir", _display(state_dir), "--tenant", tenant.tenant),
            *("--model", model, "--adapter", adapter, "--max-tokens", str(max_tokens), prompt),
        ]
    )
    return [
        f"  curl -s {gateway_url}/v1/chat/completions -H {auth} {json_type} -d {shlex.quote(chat)}",
        f"  curl -s {gateway_url}/v1/jobs -H {auth} {json_type} -d {shlex.quote(job)}",
        f"  curl -s '{gateway_url}/v1/jobs/<id>?wait=30' -H {auth}",
        f"  {submit}",
    ]
