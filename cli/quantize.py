"""`lorafleet quantize`: a plain checkpoint rounded by GPTQ on calibration text, written in a format
workers load as published, and other engines' readers too (cli/gptq_targets.py):
    --format int4  a 4-bit GPTQ checkpoint (quant_method gptq, checkpoint_format gptq, desc_act false:
                   columns were rounded in act order, but each input's group is k // G, so no reader
                   needs a permutation)
    --format fp8   an FP8 checkpoint (compressed-tensors, per-channel weight scales, activations per
                   token at run time): the same bytes and kernels as --quantization fp8 at load;
                   --unquantized keeps some projections in the source's dtype (its ignore list)
Round to nearest at load rounds each weight alone; GPTQ spends a minute to hours once (with the model's
size) to give the layers' outputs on real text a smaller error for the same bytes (docs/benchmarks.md,
"GPTQ"). The pass runs the worker's own model (cli/gptq_layers.py) on this machine's GPU if it has
one, else on its CPU.

The checkpoint written: every tensor of the source except the decoder projections' weights, which
become the format's tensors; config.json with its quantization_config; the source's other files
(tokenizer, chat template, generation config) copied. It is written beside --out and renamed into
place when whole.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cli.config_from_args import QuantizeConfig
from cli.errors import CommandError
from shared.int4_quantization import check_int4_widths
from shared.model_info import PROJECTIONS, ModelInfo, decoder_projection_name

if TYPE_CHECKING:
    import torch

    from cli.gptq_targets import GptqTarget


def run_quantize(config: QuantizeConfig) -> int:
    info = ModelInfo.from_pretrained(config.model.name, config.model.path)
    source = config.model.path
    group_size = _check(config, info)  # before torch: the cheap checks first
    import torch
    from tokenizers import Tokenizer

    from cli.gptq_layers import quantize_layers
    from cli.gptq_targets import Fp8Target, Int4Target
    from shared.config import EngineConfig
    from worker.switching.loader import new_model, served_info, stream_to_model
    from worker.switching.shard_reader import StagingRing

    unquantized = tuple(
        decoder_projection_name(layer, projection)
        for layer in range(info.num_layers)
        for projection in config.unquantized
    )
    target = Fp8Target(unquantized) if config.format == "fp8" else Int4Target(group_size)
    device = config.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        text = config.calibration.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise CommandError(f"--calibration {config.calibration} is not UTF-8 text: {exc.reason}", exit_code=2) from exc
    ids = Tokenizer.from_file(str(source / "tokenizer.json")).encode(text).ids
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
    print(f"# {info.name}: GPTQ to {target.describe()} on {device}, calibrated on {len(ids)} tokens of "
          f"{config.calibration} in {len(windows)} windows", flush=True)  # fmt: skip
    started = time.monotonic()

    def progress(index: int, seconds: float) -> None:
        print(f"# layer {index + 1}/{info.num_layers}: {seconds:.1f} s", flush=True)

    quantized = quantize_layers(model, windows, target, progress)
    write_checkpoint(source, config.out, quantized, target)
    print(f"wrote {config.out}: {len(quantized)} projections ({time.monotonic() - started:.0f} s)")
    return 0


def _check(config: QuantizeConfig, info: ModelInfo) -> int:
    """The 4-bit group (--group-size, or the one --quantization int4 would take; 0 for fp8), after
    refusing what cannot be quantized: a checkpoint already quantized, an MoE model, widths in no
    whole group, a window past the context, no tokenizer, an --out that exists."""
    source = config.model.path
    if info.checkpoint_quantization != "none":
        raise CommandError(
            f"{info.name} is already quantized ({info.checkpoint_quantization}): give its unquantized checkpoint",
            exit_code=2,
        )
    if info.is_moe:
        raise CommandError(f"{info.name} is an MoE model: lorafleet quantize rounds dense decoders only", exit_code=2)
    if config.out.exists():
        raise CommandError(f"--out {config.out} exists: give a new directory", exit_code=2)
    if config.window > info.max_context:
        raise CommandError(f"--window {config.window} is past {info.name}'s context of {info.max_context}", exit_code=2)
    if not (source / "tokenizer.json").is_file():
        raise CommandError(f"{source} has no tokenizer.json to read the calibration text with", exit_code=2)
    if config.format == "fp8":
        return 0
    if config.group_size is None:
        return info.served(quantization="int4", kv_cache_dtype="auto", source=source).weight_group_size
    check_int4_widths({name: info.projection_shape(name)[0] for name in PROJECTIONS}, config.group_size, source)
    return config.group_size


def write_checkpoint(
    source: Path, out: Path, quantized: dict[str, dict[str, torch.Tensor]], target: GptqTarget
) -> None:
    """`source`'s checkpoint into the new directory `out`, with `quantized` (projection name → its
    tensors by suffix) in place of those projections' weights."""
    from safetensors import safe_open
    from safetensors.torch import save_file

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
    for projection, parts in quantized.items():
        for suffix, tensor in parts.items():
            tensors[f"{projection}.{suffix}"] = tensor.cpu().contiguous()
    config: dict[str, Any] = json.loads((source / "config.json").read_text())
    config["quantization_config"] = target.quantization_config()
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
