"""End-to-end engine on a CUDA GPU with Qwen3-30B-A3B shapes (48 layers, hidden 2048, 128 experts,
top-8, expert width 768, 32 q / 4 kv heads of 128) in random bf16 weights: base-only beside LoRA rank
--rank on attention and every expert, --adapters adapters spread round-robin over the batch.

    python -m bench.moe [--concurrency 1 8 32] [--prompt 1600] [--new-tokens 600] [--rank 32] [--adapters 8]

Each row: `concurrency` requests added at once to an LLMEngine (bench/engine.py's harness) and
stepped to completion (greedy, ignore_eos; adapters preloaded into their slots). tok/s/req = 1 / TPOT
(the decode speed one request sees), TTFT mean over requests, aggregate = output tokens / wall time.
"""

from __future__ import annotations

import argparse
import gc
from functools import partial

import torch

from bench.engine import EngineBench
from shared.model_info import EXPERT_PROJECTIONS, ModelInfo
from worker.adapter_pool.peft_adapter import AdapterWeights

QWEN3_30B_A3B = ModelInfo(
    name="qwen3-30b-a3b-random", architecture="Qwen3MoeForCausalLM", hidden_size=2048, intermediate_size=6144,
    num_layers=48, num_heads=32, num_kv_heads=4, head_dim=128, vocab_size=151936, max_context=40960,
    rope_theta=1000000.0, rope_scaling=None, rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=False,
    bos_token_id=None, eos_token_ids=(151645,), torch_dtype="bfloat16", num_experts=128, num_experts_per_tok=8,
    moe_intermediate_size=768, norm_topk_prob=True, moe_layers=tuple(range(48)), qk_norm=True,
)  # fmt: skip


def random_moe_adapter(info: ModelInfo, seed: int, *, rank: int) -> AdapterWeights:
    """Rank-`rank` LoRA on q/k/v/o and every expert's gate/up/down, on the GPU."""
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def rand(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, device="cuda", generator=gen, dtype=torch.bfloat16) * std

    lora, experts = {}, {}
    for layer in range(info.num_layers):
        for projection in ("q_proj", "k_proj", "v_proj", "o_proj"):
            fan_in, fan_out = info.projection_shape(projection)
            lora[(layer, projection)] = (rand(rank, fan_in, std=fan_in**-0.5), rand(fan_out, rank, std=0.01))
        for projection in EXPERT_PROJECTIONS[info.architecture]:
            fan_in, fan_out = info.expert_projection_shape(projection)
            e = info.num_experts
            experts[(layer, projection)] = (rand(e, rank, fan_in, std=fan_in**-0.5), rand(e, fan_out, rank, std=0.01))
    return AdapterWeights(rank=rank, scaling=2.0, lora=lora, sha256=f"{seed:064x}", experts=experts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--prompt", type=int, default=1600)
    parser.add_argument("--new-tokens", type=int, default=600)
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--adapters", type=int, default=8)
    args = parser.parse_args()

    bench = EngineBench(
        QWEN3_30B_A3B,
        args.adapters,
        max(args.concurrency),
        args.prompt + args.new_tokens,
        rank=args.rank,
        make_adapter=partial(random_moe_adapter, rank=args.rank),
    )
    gc.collect()
    torch.cuda.empty_cache()
    # warm-up at every measured shape: Triton compiles per launch configuration, and the prefill of
    # each concurrency takes other configurations (token buckets) than a short prompt would
    for concurrency in args.concurrency:
        for adapters in (0, args.adapters):
            bench.run(concurrency, args.prompt, 2, adapters)
    rows = []
    for concurrency in args.concurrency:
        for adapters in (0, args.adapters):
            wall, ttft, tpot = bench.run(concurrency, args.prompt, args.new_tokens, adapters)
            rows.append((concurrency, adapters, 1 / tpot, ttft * 1e3, concurrency * args.new_tokens / wall))
            print(f"done c={concurrency} adapters={adapters}: {rows[-1]}", flush=True)
    print(f"\n{torch.cuda.get_device_name()}: Qwen3-30B-A3B shapes, random bf16; prompt {args.prompt}, "
          f"{args.new_tokens} new tokens; LoRA rank {args.rank} on q/k/v/o + experts' gate/up/down")  # fmt: skip
    print("| concurrency | adapters | tok/s per request | TTFT ms | aggregate tok/s | LoRA / base: tok/s/req, TTFT |")
    print("| --- | --- | --- | --- | --- | --- |")
    base: dict[int, tuple[float, float]] = {}
    for concurrency, adapters, per_req, ttft, agg in rows:
        if adapters == 0:
            base[concurrency] = (per_req, ttft)
            ratio = ""
        else:
            ratio = f"{per_req / base[concurrency][0]:.2f}×, {ttft / base[concurrency][1]:.2f}×"
        print(f"| {concurrency} | {adapters} | {per_req:.1f} | {ttft:.0f} | {agg:.0f} | {ratio} |")


if __name__ == "__main__":
    main()
