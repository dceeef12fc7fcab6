"""`lorafleet quantize`: a plain checkpoint quantized to 4 bits by GPTQ on calibration text, written as
a GPTQ checkpoint (quant_method gptq, checkpoint_format gptq, desc_act false: columns were rounded in
act order, but each input's group is k // G, so no reader needs a permutation) that workers load as
published, and that other engines' GPTQ readers load too.

Round to nearest (`--quantization int4` at load) rounds each weight alone; GPTQ spends a few minutes
once to give the layers' outputs on real text a smaller error for the same bytes (docs/benchmarks.md,
"GPTQ"). The pass runs the worker's own model (cli/gptq_layers.py) on this machine's GPU if it has
one, else on its CPU.

The checkpoint written: every tensor of the source except the decoder projections' weights, which
become each projection's qweight, qzeros, scales and g_idx (worker/model/int4_weights.py); config.json
with the quantization_config; the source's other files (tokenizer, chat template, generation config)
copied. It is written beside --out and renamed into place when whole.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from cli.config_from_args import QuantizeConfig
from cli.errors import CommandError
from shared.int4_quantization import check_int4_widths
from shared.model_info import PROJECTIONS, ModelInfo

if TYPE_CHECKING:
    from kernels.quant.int4_reference import Int4Weight


def run_quantize(config: QuantizeConfig) -> int:
    info = ModelInfo.from_pretrained(config.model.name, config.model.path)
    source = config.model.path
    group_size = _group_size(info, config.group_size, source)  # before torch: the cheap checks first
    if config.out.exists():
        raise CommandError(f"--out {config.out} exists: give a new directory", exit_code=2)
    if config.window > info.max_context:
        raise CommandError(f"--window {config.window} is past {info.name}'s context of {info.max_context}", exit_code=2)
    if not (source / "tokenizer.json").is_file():
        raise CommandError(f"{source} has no tokenizer.json to read the calibration text with", exit_code=2)
    import torch
    from tokenizers import Tokenizer

    from cli.gptq_layers import quantize_layers
    from shared.config import EngineConfig
    from worker.switching.loader import new_model, served_info, stream_to_model
    from worker.switching.shard_reader import StagingRing

    device = config.device or ("cuda" if torch.cuda.is_available() else "cpu")
    ids = Tokenizer.from_file(str(source / "tokenizer.json")).encode(config.calibration.read_text()).ids
    ids = ids[: config.tokens]
    if len(ids) < config.window:
        raise CommandError(
            f"--calibration {config.calibration} has {len(ids)} tokens, fewer than one --window of {config.window}",
            exit_code=2,
        )
    windows = [ids[start : start + config.window] for start in range(0, len(ids), config.window)]
    # float32 on a CPU (where bf16 is slow and no memory is short); the checkpoint's dtype on a GPU
    engine = EngineConfig(device=device, dtype="float32" if device == "cpu" else None, max_loras=0)
    served = served_info(config.model, engine)
    model = new_model(served, engine)
    stream_to_model(model, info.name, source, StagingRing(pin=device == "cuda"), None)
    print(f"# {info.name}: GPTQ in groups of {group_size} on {device}, calibrated on {len(ids)} tokens of "
          f"{config.calibration} in {len(windows)} windows", flush=True)  # fmt: skip
    started = time.monotonic()

    def progress(index: int, seconds: float) -> None:
        print(f"# layer {index + 1}/{info.num_layers}: {seconds:.1f} s", flush=True)

    quantized = quantize_layers(model, windows, group_size, progress)
    write_gptq_checkpoint(source, config.out, quantized, group_size)
    print(f"wrote {config.out}: {len(quantized)} projections in 4 bits ({time.monotonic() - started:.0f} s)")
    return 0


def _group_size(info: ModelInfo, asked: int | None, source: Path) -> int:
    """The group `asked` for, or the one --quantization int4 would take; refused for a checkpoint
    already quantized, an MoE model, or widths in no whole group."""
    if info.checkpoint_quantization != "none":
        raise CommandError(
            f"{info.name} is already quantized ({info.checkpoint_quantization}): give its unquantized checkpoint",
            exit_code=2,
        )
    if info.is_moe:
        raise CommandError(f"{info.name} is an MoE model: 4-bit MoE weights are not served", exit_code=2)
    widths = {name: info.projection_shape(name)[0] for name in PROJECTIONS}
    if asked is None:
        return info.served(quantization="int4", kv_cache_dtype="auto", source=source).weight_group_size
    check_int4_widths(widths, asked, source)
    return asked


def write_gptq_checkpoint(source: Path, out: Path, quantized: dict[str, Int4Weight], group_size: int) -> None:
    """`source`'s checkpoint into the new directory `out`, with `quantized` (projection name → its
    Int4Weight) in place of those projections' weights."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from worker.model.int4_weights import gptq_tensors
    from worker.model.weights import INDEX_FILE, checkpoint_files

    tensors = {}
    replaced = set()
    for path in checkpoint_files(source):
        with safe_open(path, framework="pt") as checkpoint:
            for name in checkpoint.keys():  # noqa: SIM118 (a safetensors handle has no __iter__)
                projection = name.removesuffix(".weight")
                if projection in quantized:
                    replaced.add(projection)
                else:
                    tensors[name] = checkpoint.get_tensor(name)
    if missing := sorted(set(quantized) - replaced):
        raise CommandError(f"{source}: no weight for {', '.join(missing[:3])} in the checkpoint", exit_code=2)
    for projection, weight in quantized.items():
        for suffix, tensor in gptq_tensors(weight).items():
            tensors[f"{projection}.{suffix}"] = tensor.cpu().contiguous()
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": group_size,
        "desc_act": False,
        "sym": False,
        "static_groups": True,  # the grids set before rounding, columns in act order (kernels/quant/gptq.py)
        "true_sequential": False,
        "checkpoint_format": "gptq",
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}-") as scratch:
        staged = Path(scratch) / "checkpoint"
        staged.mkdir()
        save_file(tensors, staged / "model.safetensors", metadata={"format": "pt"})
        (staged / "model.safetensors").chmod(0o644)  # safetensors writes 0600: a worker may run as another user
        (staged / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        skipped = {"config.json", INDEX_FILE, *(path.name for path in checkpoint_files(source))}
        for path in source.iterdir():
            if path.is_file() and path.name not in skipped:
                shutil.copy2(path, staged / path.name)
        staged.rename(out)
