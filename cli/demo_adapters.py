"""The demo tenants and their LoRA adapters: where each adapter lives, and the random-weight adapters of
the offline fallback model, written in PEFT's on-disk format without peft.

With the real demo model each adapter is a trained style (cli/demo_styles.py, cli/demo_assets/). The
random ones differ in rank and target modules (one uses rsLoRA scaling), so the fallback exercises
mixed ranks and both attention and MLP targets in one batch. B is non-zero (PEFT initialises it to
zero), sized so each adapter visibly changes the base model's output.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from shared.adapter_format import CONFIG_FILE, WEIGHTS_FILE
from shared.model_info import PROJECTIONS, ModelInfo

_B_STD = 0.05  # with A ~ N(0, 1/in), the update's scale is close to the base projection's output


@dataclass(frozen=True, slots=True)
class DemoAdapter:
    tenant: str
    name: str
    rank: int
    lora_alpha: float
    target_modules: tuple[str, ...]
    seed: int
    use_rslora: bool = False

    def path(self, model: str) -> str:
        """Where its version for the base model `model` lives, relative to the adapter root: the one place
        that decides the demo's adapter layout."""
        return f"{self.tenant}/{model}/{self.name}"


DEMO_ADAPTERS = (
    DemoAdapter("acme", "acme-support", rank=8, lora_alpha=16, target_modules=("q_proj", "v_proj"), seed=1),
    DemoAdapter(
        "globex",
        "globex-pirate",
        rank=16,
        lora_alpha=32,
        target_modules=("q_proj", "k_proj", "v_proj", "o_proj"),
        seed=2,
    ),
    DemoAdapter("initech", "initech-tps", rank=4, lora_alpha=8, target_modules=PROJECTIONS, seed=3, use_rslora=True),
)


def _module_path(projection: str) -> str:
    return "mlp" if projection in ("gate_proj", "up_proj", "down_proj") else "self_attn"


def lora_weights(adapter: DemoAdapter, model: ModelInfo) -> dict[str, np.ndarray]:
    """PEFT's tensor names; A is [r, in_features], B is [out_features, r]."""
    rng = np.random.default_rng(adapter.seed)
    weights = {}
    for layer in range(model.num_layers):
        for projection in adapter.target_modules:
            in_features, out_features = model.projection_shape(projection)
            prefix = f"base_model.model.model.layers.{layer}.{_module_path(projection)}.{projection}"
            a = rng.normal(0.0, in_features**-0.5, size=(adapter.rank, in_features))
            b = rng.normal(0.0, _B_STD, size=(out_features, adapter.rank))
            weights[f"{prefix}.lora_A.weight"] = a.astype(np.float32)
            weights[f"{prefix}.lora_B.weight"] = b.astype(np.float32)
    return weights


def write_demo_adapter(adapter_dir: Path, adapter: DemoAdapter, model: ModelInfo, base_model_path: Path) -> None:
    """Write `adapter_config.json` and `adapter_model.safetensors` into `adapter_dir` (which must exist)."""
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(base_model_path),
        "r": adapter.rank,
        "lora_alpha": adapter.lora_alpha,
        "lora_dropout": 0.0,
        "target_modules": list(adapter.target_modules),
        "bias": "none",
        "use_rslora": adapter.use_rslora,
        "use_dora": False,
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "inference_mode": True,
    }
    (adapter_dir / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    save_file(lora_weights(adapter, model), str(adapter_dir / WEIGHTS_FILE), metadata={"format": "pt"})
