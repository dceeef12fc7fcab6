"""A PEFT LoRA adapter's `adapter_config.json`, read with every field the server uses checked for
type and range, without torch.

The file is bounded (MAX_CONFIG_BYTES, MAX_CONFIG_DEPTH levels of nesting, no repeated keys), must
be PEFT's LORA type without features the server cannot apply, and gives: `r` a positive integer,
`lora_alpha` a finite positive number (PEFT's default 8 when absent), `use_rslora` a boolean,
`target_modules` a list of module names (a regular expression is not supported: the tensors could
not be checked against it), and for MoE experts' fused parameters `target_parameters` with
`rank_pattern` / `alpha_pattern`. Every refusal is INVALID_ADAPTER_CONFIG or ADAPTER_UNSUPPORTED
and names the field.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from shared.errors import ErrorCode, LorafleetError
from shared.expert_adapter_keys import FusedExperts, fused_experts

CONFIG_FILE = "adapter_config.json"
MAX_CONFIG_BYTES = 1 << 20
MAX_CONFIG_DEPTH = 32
PEFT_DEFAULT_ALPHA = 8  # LoraConfig.lora_alpha's default: what PEFT scales by when the file has none
_MAX_TARGETS = 1024


@dataclass(frozen=True, slots=True)
class AdapterConfig:
    rank: int
    lora_alpha: float
    use_rslora: bool
    # module names as the weights name them (the last dotted part of each target_modules entry)
    target_modules: frozenset[str]
    target_parameters: frozenset[str]
    fused_experts: FusedExperts | None  # LoRAs on fused expert parameters (their own ranks and scales)

    @property
    def max_rank(self) -> int:
        """r, or a fused expert parameter's larger rank (gate_up: 2r)."""
        fused = self.fused_experts.ranks if self.fused_experts else ()
        return max([self.rank, *(rank for _, rank in fused)])


def _invalid(message: str) -> LorafleetError:
    return LorafleetError(ErrorCode.INVALID_ADAPTER_CONFIG, f"{CONFIG_FILE}: {message}")


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        raise ValueError("a key appears twice in one object")
    return obj


_DECODER = json.JSONDecoder(object_pairs_hook=_unique)


def _depth(value: Any) -> int:
    """Nesting depth of a decoded JSON value (iteratively: the depth is the file's to choose)."""
    deepest, pending = 0, [(value, 1)]
    while pending:
        item, depth = pending.pop()
        if isinstance(item, dict | list):
            deepest = max(deepest, depth)
            pending.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def parse_adapter_config(raw: bytes) -> AdapterConfig:
    """The checked config from the file's bytes (at most MAX_CONFIG_BYTES, which the reader enforces)."""
    try:
        config = _DECODER.decode(raw.decode("utf-8"))
    except RecursionError as exc:
        raise _invalid(f"nested deeper than {MAX_CONFIG_DEPTH} levels") from exc
    except ValueError as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise _invalid(f"not valid JSON ({exc})"[:200]) from exc
    if not isinstance(config, dict):
        raise _invalid("must hold a JSON object")
    if _depth(config) > MAX_CONFIG_DEPTH:
        raise _invalid(f"nested deeper than {MAX_CONFIG_DEPTH} levels")
    _check_supported(config)
    rank = config.get("r")
    if not _is_int(rank) or rank < 1:
        raise _invalid("r must be a positive integer")
    alpha = config.get("lora_alpha", PEFT_DEFAULT_ALPHA)
    if not _is_positive_number(alpha):
        raise _invalid("lora_alpha must be a finite positive number")
    use_rslora = config.get("use_rslora", False)
    if use_rslora is not None and not isinstance(use_rslora, bool):
        raise _invalid("use_rslora must be true or false")
    target_parameters = _names(config, "target_parameters")
    if isinstance(config.get("target_modules"), str):
        raise LorafleetError(
            ErrorCode.ADAPTER_UNSUPPORTED, f"{CONFIG_FILE}: target_modules as a regular expression; list the modules"
        )
    target_modules = _names(config, "target_modules")
    if not target_modules and not target_parameters:
        raise _invalid("target_modules must list the adapted modules")
    for pattern, valid, kind in (
        ("rank_pattern", _is_int, "positive integers"),
        ("alpha_pattern", _is_positive_number, "finite positive numbers"),
    ):
        values = config.get(pattern) or {}
        if not isinstance(values, dict) or not all(valid(v) and v > 0 for v in values.values()):
            raise _invalid(f"{pattern} must map names to {kind}")
    fused = fused_experts({**config, "lora_alpha": alpha, "target_parameters": sorted(target_parameters)})
    return AdapterConfig(
        rank=rank,
        lora_alpha=float(alpha),
        use_rslora=bool(use_rslora),
        target_modules=frozenset(name.rsplit(".", 1)[-1] for name in target_modules),
        target_parameters=target_parameters,
        fused_experts=fused,
    )


def _check_supported(config: dict[str, Any]) -> None:
    peft_type = config.get("peft_type")
    if peft_type != "LORA":
        shown = repr(peft_type) if isinstance(peft_type, str | None) else type(peft_type).__name__
        raise LorafleetError(ErrorCode.ADAPTER_UNSUPPORTED, f"peft_type {shown[:40]} is not LORA")
    unsupported = {
        "use_dora": bool(config.get("use_dora")),
        "modules_to_save": bool(config.get("modules_to_save")),
        # PEFT writes rank/alpha patterns for the fused expert parameters (checked by fused_experts)
        "rank_pattern": bool(config.get("rank_pattern")) and not config.get("target_parameters"),
        "alpha_pattern": bool(config.get("alpha_pattern")) and not config.get("target_parameters"),
        "fan_in_fan_out": bool(config.get("fan_in_fan_out")),
        "bias": config.get("bias", "none") not in ("none", None),
    }
    refused = [name for name, present in unsupported.items() if present]
    if refused:
        raise LorafleetError(ErrorCode.ADAPTER_UNSUPPORTED, f"unsupported PEFT features: {', '.join(refused)}")


def _names(config: dict[str, Any], field: str) -> frozenset[str]:
    """A list-of-names field (absent or null: none)."""
    value = config.get(field)
    if value is None:
        return frozenset()
    if (
        not isinstance(value, list)
        or len(value) > _MAX_TARGETS
        or not all(isinstance(name, str) and 0 < len(name) <= 256 for name in value)
    ):
        raise _invalid(f"{field} must be a list of module names")
    return frozenset(value)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_positive_number(value: Any) -> bool:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    try:
        return math.isfinite(float(value)) and value > 0
    except OverflowError:  # an integer past float's range
        return False
