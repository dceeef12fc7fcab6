"""End-to-end engine on a CUDA GPU with Qwen3-30B-A3B shapes (48 layers, hidden 2048, 128 experts,
top-8, expert width 768, 32 q / 4 kv heads of 128) in random bf16 weights: base-only beside LoRA rank
--rank on attention and every expert, --adapters adapters spread round-robin over the batch.

    python -m bench.moe [--concurrency 1 8 32] [--prompt 1600] [--new-tokens 600] [--rank 32] [--adapters 8]
                        [--adapter-dir DIR] [--quantization none|fp8]

Each row: `concurrency` requests added at once to an LLMEngine (bench/engine_measure.py's EngineBench) and
stepped to completion (greedy, ignore_eos). The adapters are PEFT files in the per-expert form
written under --adapter-dir (~4 GB each at rank 32; kept, so a later run reuses them) and loaded
through the engine's adapter pool before any row. tok/s/req = 1 / TPOT (the decode speed one request
sees), TTFT mean over requests, aggregate = output tokens / wall time. Every expert's LoRA slots are
in the memory plan: where weights and slots do not fit (8 adapters of rank 32 on an 80 GB GPU), the
run stops at start naming --adapters / --rank.

--quantization fp8 serves the base as a worker does with that flag: every expert's gate/up/down in
fp8 (W8A16: the grouped GEMM widens them in registers), attention W8A8, each weight with a float32
scale per output row; the adapters stay bf16. Each row's roofline: output tok/s if a decode step only
read the base weights it touches and its K/V at the measured copy bandwidth, the experts counted as
the distinct ones a step's tokens route to under uniform routing (random weights route about
uniformly): E * (1 - (1 - k/E)^concurrency) of a layer's E, each at its served bytes.
"""

from __future__ import annotations

import argparse
import gc
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from bench.engine_measure import EngineBench
from bench.random_adapters import adapter_dir
from bench.random_engine import served
from bench.roofline import copy_bandwidth
from shared.adapter_digest import file_digest
from shared.adapter_format import CONFIG_FILE, WEIGHTS_FILE
from shared.expert_adapter_keys import expert_key
from shared.model_info import EXPERT_PROJECTIONS, ModelInfo
from shared.schema import AdapterRef
from worker.adapter_pool.peft_adapter import peft_key
from worker.memory_plan import MemoryPlanError

QWEN3_30B_A3B = ModelInfo(
    name="qwen3-30b-a3b-random", architecture="Qwen3MoeForCausalLM", hidden_size=2048, intermediate_size=6144,
    num_layers=48, num_heads=32, num_kv_heads=4, head_dim=128, vocab_size=151936, max_context=40960,
    rope_theta=1000000.0, rope_scaling=None, rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=False,
    bos_token_id=None, eos_token_ids=(151645,), torch_dtype="bfloat16", num_experts=128, num_experts_per_tok=8,
    moe_intermediate_size=768, norm_topk_prob=True, moe_layers=tuple(range(48)), qk_norm=True,
)  # fmt: skip


ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


def step_weight_bytes(info: ModelInfo, concurrency: int) -> float:
    """Bytes of base weights one decode step of `concurrency` sequences reads: every layer's attention
    projections, norms and router, the experts its tokens route to (expected distinct under uniform
    top-k routing), and the lm_head; fp8 projections at one byte a weight and 4 a row (the scale)."""
    h, width, experts, top_k = info.hidden_size, info.moe_intermediate_size, info.num_experts, info.num_experts_per_tok
    q, kv = info.num_heads * info.head_dim, info.num_kv_heads * info.head_dim

    def projection_bytes(weights: int, rows: int) -> int:
        return weights + 4 * rows if info.quantization == "fp8" else 2 * weights

    attention = projection_bytes(h * (q + 2 * kv) + q * h, q + 2 * kv + h)
    expert = projection_bytes(3 * h * width, 2 * width + h)
    active = experts * (1 - (1 - top_k / experts) ** concurrency)
    norms = 2 * (2 * h + 2 * info.head_dim)  # input / post-attention norms, Qwen3's q / k norms
    per_layer = attention + 2 * experts * h + active * expert + norms
    return info.num_layers * per_layer + 2 * (info.vocab_size * h + h)


def moe_roofline(info: ModelInfo, concurrency: int, context: float, bandwidth: float) -> float:
    """Output tok/s per request if a decode step only moved its base weights and K/V (`context` tokens
    a sequence) at `bandwidth` bytes/s."""
    kv = 2 * 2 * info.num_layers * info.num_kv_heads * info.head_dim * context * concurrency
    return 1 / ((step_weight_bytes(info, concurrency) + kv) / bandwidth)


def write_moe_adapter(directory: Path, info: ModelInfo, rank: int, seed: int) -> AdapterRef:
    """A PEFT adapter of `rank` on q/k/v/o and every expert's gate/up/down, in the per-expert form,
    random bf16 A (std fan_in^-0.5) and B (std 0.01), scale 2; kept if `directory` already has it."""
    weights = directory / WEIGHTS_FILE
    if not weights.is_file():
        directory.mkdir(parents=True, exist_ok=True)
        gen = torch.Generator(device="cuda").manual_seed(seed)

        def rand(*shape: int, std: float) -> torch.Tensor:
            return (torch.randn(*shape, device="cuda", generator=gen, dtype=torch.bfloat16) * std).cpu()

        tensors = {}
        for layer in range(info.num_layers):
            for projection in ATTENTION:
                fan_in, fan_out = info.projection_shape(projection)
                tensors[peft_key(layer, projection, "A")] = rand(rank, fan_in, std=fan_in**-0.5)
                tensors[peft_key(layer, projection, "B")] = rand(fan_out, rank, std=0.01)
            for projection in EXPERT_PROJECTIONS[info.architecture]:
                fan_in, fan_out = info.expert_projection_shape(projection)
                e = info.num_experts
                stacks = {"A": rand(e, rank, fan_in, std=fan_in**-0.5), "B": rand(e, fan_out, rank, std=0.01)}
                for which, stack in stacks.items():  # one tensor per expert: safetensors stores no shared views
                    for expert, tensor in enumerate(stack.unbind(0)):
                        tensors[expert_key(info, layer, expert, projection, which)] = tensor.clone()
        save_file(tensors, str(weights))
        targets = sorted({*ATTENTION, *EXPERT_PROJECTIONS[info.architecture]})
        config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": targets,
                  "lora_dropout": 0.0, "bias": "none", "task_type": "CAUSAL_LM"}  # fmt: skip
        (directory / CONFIG_FILE).write_text(json.dumps(config))
    return AdapterRef(directory.name, 1, directory.name, file_digest(weights))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--prompt", type=int, default=1600)
    parser.add_argument("--new-tokens", type=int, default=600)
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--adapter-dir", help="where the adapters' PEFT files are written, or found from an "
                        "earlier run (default: a new temporary directory)")  # fmt: skip
    parser.add_argument("--quantization", choices=("none", "fp8"), default="none",
                        help="the base's weights: bf16, or fp8 experts and projections (W8A16 / W8A8)")  # fmt: skip
    args = parser.parse_args()

    info = served(QWEN3_30B_A3B, args.quantization, "auto")
    try:
        bench = EngineBench(
            info,
            args.adapters,
            max(args.concurrency),
            args.prompt + args.new_tokens,
            adapter_dir(args.adapter_dir),
            rank=args.rank,
            make_adapter=write_moe_adapter,
        )
    except MemoryPlanError as exc:  # --adapters / --rank name the engine's --max-loras / --max-lora-rank here
        raise SystemExit(f"bench.moe: {exc}") from exc
    gc.collect()
    torch.cuda.empty_cache()
    bandwidth = copy_bandwidth()
    # warm-up at every measured shape: Triton compiles per launch configuration, and the prefill of
    # each concurrency takes other configurations (token buckets) than a short prompt would
    for concurrency in args.concurrency:
        for adapters in (0, args.adapters):
            bench.run(concurrency, args.prompt, 2, adapters)
    rows = []
    for concurrency in args.concurrency:
        for adapters in (0, args.adapters):
            wall, ttft, tpot = bench.run(concurrency, args.prompt, args.new_tokens, adapters)
            roofline = moe_roofline(info, concurrency, args.prompt + args.new_tokens / 2, bandwidth)
            rows.append((concurrency, adapters, 1 / tpot, roofline, ttft * 1e3, concurrency * args.new_tokens / wall))
            print(f"done c={concurrency} adapters={adapters}: {rows[-1]}", flush=True)
    weights = "bf16" if args.quantization == "none" else "fp8 experts (W8A16) and attention (W8A8)"
    print(f"\n{torch.cuda.get_device_name()}: Qwen3-30B-A3B shapes, random weights, {weights}; prompt {args.prompt}, "
          f"{args.new_tokens} new tokens; LoRA rank {args.rank} (bf16) on q/k/v/o + experts' gate/up/down; "
          f"copy bandwidth {bandwidth / 1e9:.0f} GB/s")  # fmt: skip
    print(
        "| concurrency | adapters | tok/s per request | roofline | of roofline | TTFT ms | aggregate tok/s "
        "| LoRA / base: tok/s/req, TTFT |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    base: dict[int, tuple[float, float]] = {}
    for concurrency, adapters, per_req, roofline, ttft, agg in rows:
        if adapters == 0:
            base[concurrency] = (per_req, ttft)
            ratio = ""
        else:
            ratio = f"{per_req / base[concurrency][0]:.2f}×, {ttft / base[concurrency][1]:.2f}×"
        print(f"| {concurrency} | {adapters} | {per_req:.1f} | {roofline:.0f} | {per_req / roofline:.2f} | {ttft:.0f} "
              f"| {agg:.0f} | {ratio} |")  # fmt: skip


if __name__ == "__main__":
    main()
