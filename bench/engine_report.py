"""bench.engine's rows and what it prints of them: the table of every row beside its roofline, the
LoRA-enabled engine's base-only rows over the engine without LoRA (issue 20), the quantization targets."""

from __future__ import annotations

from dataclasses import dataclass

from shared.model_info import ModelInfo


@dataclass
class Row:
    system: str  # "lorafleet <weights>/<kv cache>" for engine rows
    batch: int
    prompt: int
    new_tokens: int
    adapters: int
    tok_s: float
    ttft_ms: float
    tpot_ms: float
    decode_tok_s: float
    roofline_tok_s: float


LORAFLEET, NO_LORA = "lorafleet", "lorafleet no-LoRA"  # engine rows' systems: LoRA enabled, --max-loras 0
# issue 20: base-only requests on an engine with LoRA enabled keep this share of one started without LoRA
BASE_WITH_LORA_TARGET = 0.98


@dataclass(frozen=True)
class LoRAOffRatio:
    """One (batch, prompt)'s base-only row on the LoRA-enabled engine over the same row on the engine
    without LoRA: throughputs (higher is better for LoRA) and TTFT (lower is)."""

    batch: int
    prompt: int
    tok_s: float
    decode_tok_s: float
    ttft: float

    @property
    def met(self) -> bool:
        return min(self.tok_s, self.decode_tok_s) >= BASE_WITH_LORA_TARGET


def lora_off_ratios(rows: list[Row]) -> list[LoRAOffRatio]:
    """The ratio of every (batch, prompt) with a base-only row on both engines, in the rows' order."""
    off = {(r.batch, r.prompt): r for r in rows if r.system == NO_LORA}
    return [
        LoRAOffRatio(r.batch, r.prompt, r.tok_s / o.tok_s, r.decode_tok_s / o.decode_tok_s, r.ttft_ms / o.ttft_ms)
        for r in rows
        if r.system == LORAFLEET and r.adapters == 0 and (o := off.get((r.batch, r.prompt))) is not None
    ]


def engine_system(info: ModelInfo) -> str:
    """The rows' system name of an engine serving `info`: plain `lorafleet` for bf16 weights and cache;
    "fp8-mixed" weights for FP8 with some projections left in bf16."""
    if info.quantization == "none" and info.kv_cache_dtype == "auto":
        return LORAFLEET
    weights = "fp8-mixed" if info.quantization == "fp8" and info.unquantized else info.quantization
    return f"lorafleet {weights}/{info.kv_cache_dtype}"


def print_rows(rows: list[Row]) -> None:
    """Every row in one table, its decode throughput beside its roofline."""
    print(
        f"\n{'system':<25}{'batch':>6}{'prompt':>7}{'new':>5}{'adapt':>6}{'tok/s':>9}{'TTFT ms':>9}"
        f"{'TPOT ms':>9}{'decode tok/s':>13}{'roofline':>10}{'dec/roof':>9}"
    )
    for r in rows:
        share = r.decode_tok_s / r.roofline_tok_s if r.decode_tok_s else 0.0
        print(
            f"{r.system:<25}{r.batch:>6}{r.prompt:>7}{r.new_tokens:>5}{r.adapters:>6}{r.tok_s:>9.0f}"
            f"{r.ttft_ms:>9.1f}{r.tpot_ms:>9.2f}{r.decode_tok_s:>13.0f}{r.roofline_tok_s:>10.0f}{share:>9.2f}"
        )


def print_lora_off_ratios(rows: list[Row]) -> None:
    ratios = lora_off_ratios(rows)
    if not ratios:
        return
    print(
        f"\nbase-only requests, engine with LoRA / engine without LoRA (--max-loras 0); "
        f"target: tok/s and decode tok/s >= {BASE_WITH_LORA_TARGET}"
    )
    print(f"{'batch':>6}{'prompt':>7}{'tok/s':>8}{'decode':>8}{'TTFT':>7}  target")
    for r in ratios:
        verdict = "met" if r.met else "missed"
        print(f"{r.batch:>6}{r.prompt:>7}{r.tok_s:>8.3f}{r.decode_tok_s:>8.3f}{r.ttft:>7.3f}  {verdict}")


def print_targets(rows: list[Row], kv_blocks: dict[str, int]) -> None:
    """The quantization targets, each measured figure beside its bound, for the rows this run has."""
    engine = {(r.system, r.batch, r.prompt, r.adapters): r for r in rows if r.system.startswith("lorafleet")}
    fp8, mixed = "lorafleet fp8/auto", "lorafleet fp8-mixed/auto"
    if not any(system.startswith("lorafleet fp8") for system, *_ in engine):
        return
    print("\ntargets")
    for (system, batch, prompt, adapters), row in sorted(engine.items()):
        if not system.startswith("lorafleet fp8"):
            continue
        share = row.decode_tok_s / row.roofline_tok_s
        print(f"  {system} batch {batch} prompt {prompt} adapters {adapters}: {share:.2f} of its roofline (>= 0.80)")
        bf16 = engine.get((LORAFLEET, batch, prompt, adapters))
        if bf16 is not None and 8 <= batch <= 32:
            over = row.decode_tok_s / bf16.decode_tok_s
            if system == fp8:
                print(f"    decode {over:.2f}x bf16 (>= 1.7)")
            elif system == mixed:  # no target of its own: the bytes it keeps in bf16 bound it lower
                print(f"    decode {over:.2f}x bf16 (its bytes allow {row.roofline_tok_s / bf16.roofline_tok_s:.2f}x)")
        plain = engine.get((system, batch, prompt, 0))
        if plain is not None and adapters == 8:
            print(f"    8 adapters: {row.decode_tok_s / plain.decode_tok_s:.2f}x the same base without (>= 0.9)")
    for system, blocks in kv_blocks.items():
        if not system.endswith("/fp8"):
            continue
        weights = system.removeprefix("lorafleet ").split("/")[0]
        weights_only = kv_blocks.get(LORAFLEET if weights == "none" else f"lorafleet {weights}/auto")
        if weights_only:
            print(f"  {system}: {blocks / weights_only:.2f}x the KV blocks of the same weights' bf16 cache (>= 1.9)")


SPLIT_KINDS = ("gemm", "lora shrink", "lora expand", "lora metadata", "attention", "fused", "copy", "other")


def kernel_split_table(batch: int, splits: list[tuple[int, int, dict[str, float]]]) -> str:
    """Markdown table of where a step's GPU time goes (bench.engine --mixed-steps): one row per
    (prefill chunk, adapters, kernel_ms times), chunk 0 being the decode step alone. LoRA's share is
    the LoRA kernels' time over the rest's; both streams' kernels count, so it is the work LoRA
    adds, not the wall time it adds when the shrink runs beside the base GEMM."""
    header = ["chunk", "adapters", "wall ms", "gpu ms", *(f"{kind} ms" for kind in SPLIT_KINDS), "LoRA / rest"]
    lines = [f"steps of {batch} decodes (+ a prefill chunk), piecewise graphs, under the profiler",
             "| " + " | ".join(header) + " |", "|" + " ---: |" * len(header)]  # fmt: skip
    for chunk, adapters, times in splits:
        lora = sum(v for k, v in times.items() if k.startswith("lora"))
        rest = times["gpu"] - lora
        kinds = [f"{times.get(kind, 0.0):.3f}" for kind in SPLIT_KINDS]
        share = f"{lora / rest:.1%}" if rest else "–"
        cells = [str(chunk), str(adapters), f"{times['wall']:.2f}", f"{times['gpu']:.2f}", *kinds, share]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
