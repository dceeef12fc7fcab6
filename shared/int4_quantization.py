"""4-bit group-wise checkpoints (W4A16), read from a checkpoint's `quantization_config` without torch.

Two published formats load as they are (worker/model/int4_weights.py repacks both into one layout):
    quant_method "awq"   AutoAWQ, version "gemm": per projection `qweight` int32 [K, N / 8] (packed
                         along N), `qzeros` int32 [K / G, N / 8], `scales` float16 [K / G, N]
    quant_method "gptq"  AutoGPTQ / GPTQModel, checkpoint_format "gptq": `qweight` int32 [K / 8, N]
                         (packed along K), `qzeros` int32 [K / G, N / 8] (stored minus one),
                         `scales` float16 [K / G, N], `g_idx` int32 [K] (not read: with
                         desc_act false, the only order served, g_idx[k] is k // G)
both with bits 4 and a group size G of 32, 64 or 128 inputs. A plain checkpoint served with
--quantization int4 is quantized at load in groups of 128 (LOAD_GROUP_SIZES). Anything else is refused at
start, naming the file and the problem. bitsandbytes' NF4 and FP4 (codebook formats, not affine) are
read by shared/bnb_quantization.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NoReturn

from shared.errors import ErrorCode, LorafleetError

INT4_METHODS = ("awq", "gptq")
# bitsandbytes' 4-bit codebooks: "nf4" quantized at load or published, "fp4" published
CODEBOOK_FORMATS = ("nf4", "fp4")
# the served formats whose weights are 4-bit: quantized at load ("int4", "nf4") or loaded as published
INT4_FORMATS = ("int4", *INT4_METHODS, *CODEBOOK_FORMATS)
# the kernel's K tile divides the group and is at least 32 inputs (kernels/quant/int4_gemm.py)
GROUP_SIZES = (32, 64, 128)
# what --quantization int4 quantizes a plain checkpoint in: the group AWQ and GPTQ publish (128), or,
# for a model whose widths are not whole groups of 128 (SmolLM2-135M: hidden 576), the largest
# smaller group that fits
LOAD_GROUP_SIZES = (128, 64, 32)


def check_int4_checkpoint(quant: dict[str, Any], path: Path) -> str:
    """The format ("awq" or "gptq") of a 4-bit checkpoint's quantization_config `quant`, after checking
    the worker can serve it; raises LorafleetError naming `path` and the problem."""
    method = quant.get("quant_method")
    bits = quant.get("bits", quant.get("w_bit"))
    if bits != 4:
        _refuse(path, f"{method} checkpoint with {bits}-bit weights: only 4-bit weights are supported")
    if method == "awq":
        version = str(quant.get("version", "gemm")).lower()
        if version != "gemm":
            _refuse(path, f"AWQ version {version!r} is not supported: only 'gemm' packing")
        if not quant.get("zero_point", True):
            _refuse(path, "AWQ without zero points (zero_point false) is not supported")
    else:
        if quant.get("desc_act"):
            _refuse(path, "GPTQ with desc_act true (activation order, groups permuted by g_idx) is not supported")
        checkpoint_format = quant.get("checkpoint_format", "gptq")
        if checkpoint_format != "gptq":
            _refuse(path, f"GPTQ checkpoint_format {checkpoint_format!r} is not supported: only 'gptq'")
    checkpoint_group_size(quant, path)
    return method


def checkpoint_group_size(quant: dict[str, Any], path: Path) -> int:
    """The inputs per scale group of a 4-bit checkpoint's quantization_config `quant`."""
    group = quant.get("group_size", quant.get("q_group_size"))
    if group not in GROUP_SIZES:
        _refuse(path, f"group_size {group} is not supported (supported: {', '.join(map(str, GROUP_SIZES))})")
    return group


def check_int4_widths(widths: dict[str, int], group_size: int, path: Path) -> None:
    """Every projection's input width (`widths`: name → K) must be whole groups."""
    for name, width in widths.items():
        if width % group_size:
            _refuse(path, f"{name}'s input width {width} is not a multiple of the 4-bit group size {group_size}")


def load_group_size(widths: dict[str, int], path: Path) -> int:
    """The group --quantization int4 quantizes a plain checkpoint in: the first of LOAD_GROUP_SIZES
    that divides every projection's input width (`widths`: name → K)."""
    for group in LOAD_GROUP_SIZES:
        if all(width % group == 0 for width in widths.values()):
            return group
    odd = ", ".join(f"{name} {width}" for name, width in widths.items() if width % LOAD_GROUP_SIZES[-1])
    _refuse(path, f"--quantization int4 needs input widths in whole groups of {LOAD_GROUP_SIZES[-1]} or more; "
                  f"this model has {odd}")  # fmt: skip


def _refuse(path: Path, problem: str) -> NoReturn:
    raise LorafleetError(ErrorCode.INVALID_REQUEST, f"{path}: {problem}")
