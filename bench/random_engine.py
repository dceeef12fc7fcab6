"""The engines the benchmarks measure: Llama-3-8B's shapes (or any ModelInfo) over random weights, built
as a worker builds its engine, and the random prompts they are fed. Shared by bench/engine.py, the
other engine benchmarks and tests."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch
from tokenizers import Tokenizer, models

from bench.int4 import quantize_random
from kernels.quant import quantize_weight
from shared.config import EngineConfig
from shared.model_info import ModelInfo, decoder_projection_name
from worker.adapter_pool.host_adapter import max_adapter_bytes
from worker.engine.engine import LLMEngine
from worker.engine.model_runner import ModelRunner
from worker.engine.step_channel import StepChannel
from worker.memory_plan import DeviceMemory, kv_storage_bytes, model_footprint, plan_memory
from worker.metrics import WorkerMetrics
from worker.model.lora_linear import LoRALinear
from worker.model.model import CausalLM
from worker.model.moe import MoEBlock
from worker.model.parallel.group import TensorParallel

LLAMA3_8B = ModelInfo(
    name="llama-3-8b-random",
    architecture="LlamaForCausalLM",
    hidden_size=4096,
    intermediate_size=14336,
    num_layers=32,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    vocab_size=128256,
    max_context=8192,
    rope_theta=500000.0,
    rope_scaling=None,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    attention_bias=False,
    bos_token_id=128000,
    eos_token_ids=(128001,),
    torch_dtype="bfloat16",
)
RANK = 16
PREFILL_TOKENS_PER_STEP = 16384  # longer prefills are chunked (the engine's max_num_batched_tokens)


# "fp8-mixed": FP8 but for these projections, kept in bf16 in every layer: the set that kept W8A8 within
# +1% of bf16 perplexity on the demo model (docs/benchmarks.md, "Mixed precision")
MIXED_FP8_UNQUANTIZED = ("q_proj", "k_proj", "v_proj", "down_proj")


def served(info: ModelInfo, weights: str, kv_cache: str) -> ModelInfo:
    """`info` served with weights `weights` ("none": bf16, "fp8", "fp8-mixed", "int4" or "nf4") and a `kv_cache`
    ("auto" or "fp8") cache, as a CUDA worker serves it by default (int4's tensor-core copy held); "fp8-mixed"
    as an FP8 checkpoint whose ignore list names MIXED_FP8_UNQUANTIZED in every layer is served."""
    quantization = {"none": None, "fp8-mixed": "fp8"}.get(weights, weights)
    served_info = info.served(
        quantization=quantization, kv_cache_dtype=kv_cache, source=Path(info.name), int4_decode_copy=True
    )
    if weights != "fp8-mixed":
        return served_info
    names = [decoder_projection_name(layer, p) for layer in range(info.num_layers) for p in MIXED_FP8_UNQUANTIZED]
    return replace(served_info, unquantized=tuple(names))


def random_model(info: ModelInfo, config: EngineConfig, tp: TensorParallel | None = None) -> CausalLM:
    """`info`'s model (a tensor-parallel rank's share with `tp`) on config.device in bf16 with random
    weights (N(0, 0.02), norms 1): a checkpoint of this size is not written to disk for a benchmark."""
    torch.manual_seed(0)
    model = CausalLM(
        info,
        max_loras=config.max_loras,
        max_lora_rank=config.max_lora_rank,
        dtype=torch.bfloat16,
        device=config.device,
        tp=tp,
    )
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif param.dtype == torch.bfloat16:
                param.normal_(0.0, 0.02)
        for module in model.modules():
            if isinstance(module, LoRALinear) and module.weight_scale is not None:  # fp8: quantized as at load
                weight, scale = quantize_weight(
                    torch.empty_like(module.weight, dtype=torch.bfloat16).normal_(0.0, 0.02)
                )
                module.weight.copy_(weight)
                module.weight_scale.copy_(scale)
            elif isinstance(module, LoRALinear) and module.weight is None:  # int4, nf4: quantized as at load
                quantize_random(module, info.weight_group_size)
            elif isinstance(module, MoEBlock) and module.w13_scale is not None:  # fp8 experts: as at load
                for weight, scale in ((module.w13, module.w13_scale), (module.w2, module.w2_scale)):
                    for expert in range(len(weight)):  # one expert at a time: no transient copy of the stack
                        quantized, scales = quantize_weight(
                            torch.empty_like(weight[expert], dtype=torch.bfloat16).normal_(0.0, 0.02)
                        )
                        weight[expert].copy_(quantized)
                        scale[expert].copy_(scales)
    return model


def word_tokenizer(vocab_size: int) -> Tokenizer:
    return Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab_size)}, unk_token="w0"))


def random_runner(info: ModelInfo, config: EngineConfig, channel: StepChannel | None = None) -> ModelRunner:
    """A runner over random weights, built in the order a worker builds one
    (worker/switching/residency.py): the memory plan first, which fails naming the setting to change
    if the configuration cannot fit, then the model, the plan's KV storage and the runner (its decode
    graphs captured). On a CPU there is no device memory to plan: config.num_kv_blocks blocks.
    `channel`: a tensor-parallel rank's (bench/tensor_parallel.py)."""
    if torch.device(config.device).type == "cpu":
        model = random_model(info, config, channel.tp if channel is not None else None)
        nbytes = kv_storage_bytes(model_footprint(info, config), config.num_kv_blocks, config)
        return ModelRunner(model, config, torch.zeros(nbytes, dtype=torch.uint8), config.num_kv_blocks, channel=channel)
    plan = plan_memory({info.name: info}, config, memory=DeviceMemory.measure(torch.device(config.device)))
    print(f"memory plan: {json.dumps(plan.summary())}", flush=True)
    model = random_model(info, config, channel.tp if channel is not None else None)
    storage = torch.zeros(plan.kv_storage_bytes, dtype=torch.uint8, device=config.device)
    return ModelRunner(model, config, storage, plan.kv_blocks(info.name), channel=channel)


def random_engine(
    info: ModelInfo,
    config: EngineConfig,
    adapter_root: Path,
    metrics: WorkerMetrics | None = None,
    channel: StepChannel | None = None,
) -> LLMEngine:
    """The engine around random_runner(info, config, channel); adapters reach it through its adapter
    pool, from PEFT files under `adapter_root`."""
    runner = random_runner(info, config, channel)
    metrics = metrics or WorkerMetrics(config.device)
    return LLMEngine(runner, word_tokenizer(info.vocab_size), config, adapter_root, metrics.engine(info.name))


def engine_config(
    info: ModelInfo,
    max_adapters: int,
    max_seqs: int,
    max_context: int,
    *,
    rank: int = RANK,
    lora: bool = True,
    tensor_parallel: int = 1,
) -> EngineConfig:
    """The bench engine's settings: bf16, KV cache for max_seqs sequences of max_context tokens (block
    size 16), a pool of max_adapters adapters of `rank` (lora False: none, --max-loras 0)."""
    return EngineConfig(
        device="cuda",
        dtype="bfloat16",
        max_num_seqs=max_seqs,
        max_num_batched_tokens=PREFILL_TOKENS_PER_STEP,
        num_kv_blocks=max_seqs * -(-max_context // 16),
        block_size=16,
        max_loras=max(max_adapters, 1) if lora else 0,
        max_lora_rank=rank,
        # a max-rank adapter's file (an MoE one's experts: GBs), with room for its header
        max_adapter_bytes=max(
            EngineConfig().max_adapter_bytes, 2 * max_adapter_bytes(info, max_rank=rank, dtype=torch.bfloat16)
        ),
        tensor_parallel=tensor_parallel,
    )


def prompts(batch: int, length: int, vocab: int) -> list[tuple[int, ...]]:
    gen = torch.Generator().manual_seed(batch * 7919 + length)
    return [tuple(torch.randint(0, vocab, (length,), generator=gen).tolist()) for _ in range(batch)]
