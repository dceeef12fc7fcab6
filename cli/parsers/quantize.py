"""The parser of `quantize`."""

from __future__ import annotations

import argparse
from pathlib import Path

from cli import commands, flag_types
from shared.int4_quantization import GROUP_SIZES
from shared.model_info import PROJECTIONS


def add_quantize(subparsers: argparse._SubParsersAction) -> None:
    quantize = subparsers.add_parser(
        "quantize",
        help="quantize a checkpoint to 4 bits or FP8 with GPTQ, for workers to serve as published",
        description="Quantize a plain (bf16/fp16/fp32) checkpoint with GPTQ, calibrated on a text of yours, to "
        "4-bit weights (a GPTQ checkpoint: quant_method gptq, desc_act false) or FP8 ones (compressed-tensors, "
        "a scale per output channel), which a worker serves as they are. Closer to the model than "
        "--quantization int4 or fp8's round to nearest at load, for the same bytes (cli/quantize.py).",
    )
    quantize.add_argument(
        "--model", type=flag_types.model_spec, required=True, metavar="NAME=PATH", help="HF model dir (unquantized)"
    )
    quantize.add_argument(
        "--format",
        choices=("int4", "fp8"),
        default="int4",
        help="int4: a 4-bit GPTQ checkpoint; fp8: an FP8 compressed-tensors one (default: %(default)s)",
    )
    quantize.add_argument("--out", type=Path, required=True, help="the new checkpoint's directory (must not exist)")
    quantize.add_argument(
        "--calibration",
        type=Path,
        required=True,
        help="a UTF-8 text like what the model will serve (its tokens are what GPTQ fits the layers' outputs to)",
    )
    quantize.add_argument(
        "--tokens", type=flag_types.positive_int, default=16384, help="calibration tokens (default: %(default)s)"
    )
    quantize.add_argument(
        "--window", type=flag_types.positive_int, default=512, help="tokens a sequence (default: %(default)s)"
    )
    quantize.add_argument(
        "--group-size",
        type=int,
        choices=GROUP_SIZES,
        help="int4: inputs per scale (default: the largest that divides every projection's input width)",
    )
    quantize.add_argument(
        "--unquantized",
        nargs="+",
        choices=PROJECTIONS,
        default=(),
        metavar="PROJECTION",
        help="fp8: projections left in the checkpoint's dtype in every layer, listed in the checkpoint's ignore "
        "list (whole GEMMs: q_proj k_proj v_proj together, gate_proj up_proj together); they cost their bf16 "
        "bytes at decode and spare their activations FP8's rounding in prefill",
    )
    quantize.add_argument(
        "--device", type=flag_types.device_name, default="auto", help="auto (cuda if there is one), cpu, cuda or cuda:N"
    )
    quantize.set_defaults(run=commands.quantize)
