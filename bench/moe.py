"""End-to-end engine on a CUDA GPU with Qwen3-30B-A3B shapes (48 layers, hidden 2048, 128 experts,
top-8, expert width 768, 32 q / 4 kv heads of 128) in random bf16 weights: base-only beside LoRA rank
--rank on attention and every expert, --adapters adapters spread round-robin over the batch.

    python -m bench.moe [--concurrency 1 8 32] [--prompt 1600] [--new-tokens 600] [--rank 32] [--adapters 8]
                        [--adapter-dir DIR]

Each row: `concurrency` requests added at once to an LLMEngine (bench/engine.py's harness) and
stepped to completion (greedy, ignore_eos). The adapters are PEFT files in the per-expert form
written under --adapter-dir (~4 GB each at rank 32; kept, so a later run reuses them) and loaded
through the engine's adapter pool before any row. tok/s/req = 1 / TPOT (the decode speed one request
sees), TTFT mean over requests, aggregate = output tokens / wall time. Every expert's LoRA slots are
in the memory plan: where weights and slots do not fit (8 adapters of rank 32 on an 80 GB GPU), the
run stops at start naming --adapters / --rank.
"""

from __future__ import annotations

import argparse
import gc
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from bench.engine import EngineBench, adapter_dir
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
    args = parser.parse_args()

    try:
        bench = EngineBench(
            QWEN3_30B_A3B,
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
