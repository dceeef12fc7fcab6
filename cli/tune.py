"""`lorafleet tune`: the LoRA plans of one model's shapes, tuned on this machine's GPU by hand.

The tuner a worker runs at start within its budget (worker/kernel_plans.py), run to the end (or to
--budget-s) for every bucket asked for, printing each kernel's timings as it goes and the layer's
table at the end.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from cli.config_from_args import TuneConfig
from cli.errors import CommandError
from shared.config import EngineConfig
from shared.model_info import ModelInfo

if TYPE_CHECKING:
    from kernels.lora.tuning import BucketResult


def run_tune(config: TuneConfig) -> int:
    info = ModelInfo.from_pretrained(config.model.name, config.model.path)
    import torch  # after the cheap checks: torch takes seconds to import

    if not torch.cuda.is_available():
        raise CommandError("`lorafleet tune` times kernels on a CUDA GPU, and torch sees none here", exit_code=2)
    from kernels.lora.configs import config_file
    from kernels.lora.tiles import rank_pad
    from worker.kernel_plans import adapted_layer, describe, pool_rank, token_buckets, tune_buckets

    buckets = config.buckets or token_buckets(EngineConfig().max_num_batched_tokens)
    shapes = adapted_layer(info, config.max_lora_rank)
    rank = pool_rank(info, config.max_lora_rank)
    device_name = torch.cuda.get_device_name()
    plan_file = config_file(device_name, config.plans_dir)
    tokens = " ".join(map(str, buckets))
    command = f"lorafleet tune --model {info.name} --max-lora-rank {config.max_lora_rank} --tokens {tokens}"
    print(f"# {info.name} ({info.architecture}) on {device_name}: rank_pad {rank_pad(rank)}, {describe(shapes)}")
    print(f"# buckets {tokens}; plans into {plan_file}", flush=True)

    def progress(result: BucketResult, elapsed_s: float, left: Sequence[int]) -> None:
        print(f"# T={result.num_tokens}: {result.chosen}, +{100 * result.over_base:.1f}% over base", end="")
        print(f" ({elapsed_s:.0f} s, buckets left: {' '.join(map(str, left)) or 'none'})", flush=True)

    start = time.monotonic()
    run = tune_buckets(
        shapes,
        rank,
        buckets,
        plan_file,
        device_name=device_name,
        command=command,
        budget_s=config.budget_s,
        on_bucket=progress,
        echo=lambda line: print(line, flush=True),
    )
    print(layer_table(run.results))
    if run.not_reached:
        print(f"# --budget-s {config.budget_s:g} ran out before buckets {' '.join(map(str, run.not_reached))}")
    print(f"# wrote {len(run.results)} buckets' plans to {plan_file} in {time.monotonic() - start:.0f} s")
    return 0


def layer_table(results: Sequence[BucketResult]) -> str:
    """The served layer per tuned bucket: the chosen path, its time and the base layer's (us)."""
    lines = [f"{'T':>6}  {'chosen':<20} {'base_us':>9} {'served_us':>9} {'over%':>6}"]
    for r in results:
        base, served = r.layer_us["base"], r.layer_us[r.chosen]
        lines.append(f"{r.num_tokens:>6}  {r.chosen:<20} {base:>9.1f} {served:>9.1f} {100 * r.over_base:>6.1f}")
    return "\n".join(lines)
