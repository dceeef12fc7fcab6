"""The state directory of `lorafleet up` and the two files in it that other commands read.

`lorafleet.json` says where a running `up` keeps everything (Redis URL, models, adapter root,
gateway URL), so `lorafleet worker --state-dir DIR` can join it and the admin commands can reach
its Redis. `demo.json` holds the demo tenants' API keys, which Redis stores only hashed.
"""

from __future__ import annotations

import json
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from cli.errors import CommandError

DEFAULT_STATE_DIR = Path(".lorafleet")
STATE_FILE = "lorafleet.json"
DEMO_FILE = "demo.json"
ADMIN_KEY_FILE = "admin_key"
KERNEL_PLANS_DIR = "kernel-plans"  # LoRA plans tuned on this machine (worker/kernel_plans.py)


class StateError(CommandError):
    """The state directory lacks a file a command needs, or holds one it cannot read."""

    def __init__(self, message: str) -> None:
        super().__init__(message, exit_code=2)


@dataclass(frozen=True, slots=True)
class FleetState:
    redis_url: str
    models: dict[str, Path]  # name → HF-format model directory
    adapter_root: Path
    gateway_url: str

    def save(self, state_dir: Path) -> None:
        data = {
            "redis_url": self.redis_url,
            "models": {name: str(path) for name, path in self.models.items()},
            "adapter_root": str(self.adapter_root),
            "gateway_url": self.gateway_url,
        }
        write_json(state_dir / STATE_FILE, data)

    @classmethod
    def load(cls, state_dir: Path) -> FleetState:
        data = read_json(state_dir / STATE_FILE)
        try:
            return cls(
                redis_url=data["redis_url"],
                models={name: Path(path) for name, path in data["models"].items()},
                adapter_root=Path(data["adapter_root"]),
                gateway_url=data["gateway_url"],
            )
        except (KeyError, TypeError, AttributeError) as exc:
            raise StateError(f"{state_dir / STATE_FILE} is malformed: missing or wrong {exc}") from exc

    @classmethod
    def exists(cls, state_dir: Path) -> bool:
        return (state_dir / STATE_FILE).is_file()


def read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise StateError(f"{path} does not exist (is `lorafleet up` running with this state dir?)") from None
    except (OSError, ValueError) as exc:
        raise StateError(f"cannot read {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise StateError(f"{path} must hold a JSON object")
    return data


def write_json(path: Path, data: dict, *, private: bool = False) -> None:
    """Replace `path` atomically (a reader never sees half a file); `private` files are owner-only."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.unlink(missing_ok=True)  # os.open keeps an existing file's mode
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o644)
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)


def ensure_admin_key(state_dir: Path) -> Path:
    """The admin API key of this state dir's fleet, generated once into an owner-only file."""
    path = state_dir / ADMIN_KEY_FILE
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(f"lfadmin_{secrets.token_urlsafe(32)}\n")
    return path
