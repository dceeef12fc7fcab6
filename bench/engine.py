"""End-to-end engine throughput on a CUDA GPU, Llama-3-8B shapes with random bf16 weights, beside
transformers(+PEFT) on the same workload and the decode roofline.

    python -m bench.engine [--batches 1 8 32 64 128] [--prompts 128 1024] [--new-tokens 128]
                           [--adapters 0 8 32] [--hf-batch 32 --hf-prompt 128 --hf-new-tokens N --hf-adapters 0 8]
                           [--profile-batch 32] [--adapter-dir DIR]
                           [--quantization none fp8 int4] [--kv-cache-dtype auto fp8]

Engine rows: all requests are added at once to an LLMEngine (scheduler, paged KV, multi-LoRA, the
GPU sampler; greedy, ignore_eos) and stepped to completion. The engine is built as a worker builds
one (the memory plan, then the model, its KV storage and runner), over random weights. Adapters are
rank 16 on all seven projections, PEFT files written under --adapter-dir (kept, so a later run
reuses them), spread round-robin over the batch, and loaded through the engine's adapter pool
before any row is timed.
Each (batch, prompt) shape first runs once untimed (prefill and one decode, with adapters), so no row
pays a first-use compile. With 0 among --adapters, the base-only rows run a second time, on an engine
built as a worker started with --max-loras 0 builds it (no LoRA memory or kernels; system "lorafleet
no-LoRA"), after the first engine is freed; a last table gives the LoRA-enabled engine's base-only
rows over those (issue 20's target: within 2%, ratio >= 0.98 of tok/s and decode tok/s).
    tok/s   output tokens / wall time of the whole run (prefill included)
    TTFT    mean over requests of (first token - start)
    TPOT    mean over requests of (last token - first token) / (new tokens - 1)
    decode  output tok/s of the decode steps alone (batch / TPOT)
Pure-decode steps replay CUDA graphs (worker/engine/cuda_graphs.py), captured when the runner is built.
--profile-batch B: instead, where one decode step of B sequences (prompt: the first of --prompts)
goes, per adapter count: wall time and GPU kernel time by kind (torch.profiler), with decode graphs
and eagerly.
--mixed-steps B: instead, the time of the steps that admit requests against a decode step: per
adapter count (spread round-robin over the rows), the model runner's mean step time, host and GPU
overlapped as the engine runs them, for B decoding sequences (context: the first of --prompts) alone
(decode graph), and beside a prefill chunk of each --chunks size, through the piecewise graphs and
eagerly.
Roofline (per decode step): all weights read once (lm_head included, embedding rows excluded) plus
each sequence's K/V at its mean decode context, over the measured device-to-device copy bandwidth;
in each row's own formats (fp8 projections: one byte a weight; int4: half a byte a weight and a
float16 scale and zero point per group of 128; an fp8 KV cache: one byte an element).
--quantization / --kv-cache-dtype: engine rows for every combination given (weights "none": bf16),
each with the KV blocks its memory plan gives on this GPU, and the issue's targets checked at the end
(FP8 decode >= 1.7x bf16 at batch 8-32 and >= 80% of its roofline; 8 adapters >= 0.9x the same
quantized base; KV blocks >= 1.9x with an FP8 KV cache; 4-bit (int4: random weights quantized as
at load, bench/int4.py) decode >= 2.5x bf16 at batch 1-8).
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, models

from bench.int4 import int4_projection_bytes, print_int4_targets, quantize_random
from kernels.quant import quantize_weight
from shared.adapter_digest import file_digest
from shared.adapter_format import CONFIG_FILE, WEIGHTS_FILE
from shared.config import EngineConfig
from shared.model_info import PROJECTIONS, ModelInfo
from shared.schema import AdapterRef, SamplingParams
from worker.adapter_pool.host_adapter import max_adapter_bytes
from worker.adapter_pool.peft_adapter import peft_key
from worker.engine.block_manager import BlockManager
from worker.engine.engine import EngineRequest, LLMEngine
from worker.engine.model_runner import ModelRunner
from worker.engine.scheduler import ScheduledSequence
from worker.engine.sequence import Sequence
from worker.engine.step_channel import StepChannel
from worker.memory_plan import DeviceMemory, kv_storage_bytes, model_footprint, plan_memory
from worker.metrics import WorkerMetrics
from worker.model.lora_linear import LoRALinear
from worker.model.model import CausalLM
from worker.model.moe import MoEBlock
from worker.model.parallel.group import TensorParallel
from worker.tensor_parallel import Followers

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
TP_DEFAULTS = {"batches": [1, 32, 64], "prompts": [128], "adapters": [0, 8]}  # bench/tensor_parallel.py's grid
LORAFLEET, NO_LORA = "lorafleet", "lorafleet no-LoRA"  # engine rows' systems: LoRA enabled, --max-loras 0
# issue 20: base-only requests on an engine with LoRA enabled keep this share of one started without LoRA
BASE_WITH_LORA_TARGET = 0.98


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


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second (median of 20 copies of 1 GiB)."""
    src = torch.empty(1 << 29, dtype=torch.int16, device="cuda").random_()
    dst = torch.empty_like(src)
    times = []
    for _ in range(22):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * src.numel() * src.element_size() / sorted(times[2:])[10]


def weight_bytes(info: ModelInfo) -> int:
    """Bytes a decode step reads: every layer's weights and the lm_head (embedding rows are few); the
    projections in one byte each (and a float32 scale per output row) when served in fp8, in half a
    byte (and a float16 scale and zero point per group) in 4 bits."""
    h, i, kv = info.hidden_size, info.intermediate_size, info.num_kv_heads * info.head_dim
    rows = (h + 2 * kv) + h + 2 * i + h
    projections = h * (h + 2 * kv) + h * h + 3 * h * i
    projection_bytes = projections + 4 * rows if info.quantization == "fp8" else 2 * projections
    if info.quantization == "int4":
        projection_bytes = int4_projection_bytes(info)
    return info.num_layers * (projection_bytes + 2 * 2 * h) + 2 * (info.vocab_size * h + h)


def roofline(info: ModelInfo, batch: int, context: float, bandwidth: float) -> float:
    """Output tok/s if a decode step only moved its weights and K/V at `bandwidth` bytes/s."""
    kv_element = 1 if info.kv_cache_dtype == "fp8" else 2
    kv = 2 * kv_element * info.num_layers * info.num_kv_heads * info.head_dim * context * batch
    return batch / ((weight_bytes(info) + kv) / bandwidth)


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
            elif isinstance(module, LoRALinear) and module.weight is None:  # int4: quantized as at load
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
        return ModelRunner(
            model, config, torch.zeros(nbytes, dtype=torch.uint8), config.num_kv_blocks, channel=channel
        )
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


def write_adapter(directory: Path, info: ModelInfo, rank: int, seed: int) -> AdapterRef:
    """A PEFT adapter of `rank` on every projection, random bf16 A (std fan_in^-0.5) and B (std 0.01),
    scale 2 (alpha = 2 * rank), in `directory` (kept if it is already there: the same seed writes the
    same file); returns its registry reference, its path relative to `directory`'s parent."""
    weights = directory / WEIGHTS_FILE
    if not weights.is_file():
        directory.mkdir(parents=True, exist_ok=True)
        gen = torch.Generator().manual_seed(seed)
        tensors = {}
        for layer in range(info.num_layers):
            for projection in PROJECTIONS:
                fan_in, fan_out = info.projection_shape(projection)
                a = torch.randn(rank, fan_in, generator=gen) * fan_in**-0.5
                tensors[peft_key(layer, projection, "A")] = a.to(torch.bfloat16)
                tensors[peft_key(layer, projection, "B")] = (torch.randn(fan_out, rank, generator=gen) * 0.01).to(
                    torch.bfloat16
                )
        save_file(tensors, str(weights))
        config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(PROJECTIONS)}
        (directory / CONFIG_FILE).write_text(json.dumps(config))
    return AdapterRef(directory.name, 1, directory.name, file_digest(weights))


def adapter_name(info: ModelInfo, rank: int, seed: int) -> str:
    """The directory of a benchmark adapter in the adapter root, named by everything its file depends
    on: write_adapter keeps a file already there, and runs of several shapes (bench/tensor_parallel.py's
    8B and 70B) or an --adapter-dir shared between runs must not serve one shape another's (issue #26)."""
    return f"bench-{info.name}-r{rank}-{seed}"


def adapter_dir(path: str | None) -> Path:
    """Where adapter files go: `path` (made if missing), else a new temporary directory."""
    if path is None:
        return Path(tempfile.mkdtemp(prefix="bench-adapters-", dir="/var/tmp" if Path("/var/tmp").is_dir() else None))
    Path(path).mkdir(parents=True, exist_ok=True)
    return Path(path)


def load_adapters(engine: LLMEngine, refs: list[AdapterRef]) -> None:
    """Bring every adapter of `refs` onto the device through the engine's adapter pool, as a worker does
    for the requests naming them: one one-token request each, run to completion."""
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    for index, ref in enumerate(refs):
        engine.add(EngineRequest(job_id=f"load-{index}", prompt_token_ids=(1, 2, 3), sampling=params, adapter=ref))
    results = []
    while engine.num_unfinished:
        results += engine.step()
    failed = [r for r in results if r.error is not None]
    assert not failed, f"adapters did not load: {failed[0].error}"
    resident = set(engine.adapter_slots.resident)
    assert all(ref.uid in resident for ref in refs), "an adapter was evicted: the pool is smaller than the set"


def prompts(batch: int, length: int, vocab: int) -> list[tuple[int, ...]]:
    gen = torch.Generator().manual_seed(batch * 7919 + length)
    return [tuple(torch.randint(0, vocab, (length,), generator=gen).tolist()) for _ in range(batch)]


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


class EngineBench:
    def __init__(
        self,
        info: ModelInfo,
        max_adapters: int,
        max_seqs: int,
        max_context: int,
        adapter_root: Path,
        *,
        rank: int = RANK,
        make_adapter: Callable[[Path, ModelInfo, int, int], AdapterRef] = write_adapter,
        lora: bool = True,
        followers: Followers | None = None,
    ) -> None:
        """KV cache sized for max_seqs sequences of max_context tokens (block size 16); the pool holds
        max_adapters adapters of rank `rank`, make_adapter(adapter_root / adapter_name(info, rank, i), info,
        rank, i), loaded before any run. lora False: the engine of a worker started with --max-loras 0 (no
        adapters). `followers`: this process is rank 0 of their tensor-parallel group (bench/tensor_parallel.py)."""
        if not lora and max_adapters:
            raise ValueError("an engine without LoRA takes no adapters")
        self.info = info
        channel = followers.channel if followers is not None else None
        self.config = engine_config(
            info,
            max_adapters,
            max_seqs,
            max_context,
            rank=rank,
            lora=lora,
            tensor_parallel=channel.tp.size if channel else 1,
        )
        start = time.perf_counter()
        self.engine = random_engine(info, self.config, adapter_root, channel=channel)  # first: it says if sizes fit
        self.runner = self.engine.runner
        self.setup_s = time.perf_counter() - start  # memory plan, weights, KV cache, decode graph capture
        names = [adapter_name(info, rank, i) for i in range(max_adapters)]
        self.refs = [make_adapter(adapter_root / name, info, rank, i) for i, name in enumerate(names)]
        load_adapters(self.engine, self.refs)

    def run(self, batch: int, prompt: int, new_tokens: int, adapters: int) -> tuple[float, float, float]:
        """(wall s, mean TTFT s, mean TPOT s) of one batch run to completion."""
        engine = self.engine
        params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
        for i, tokens in enumerate(prompts(batch, prompt, self.info.vocab_size)):
            adapter = self.refs[i % adapters] if adapters else None
            engine.add(EngineRequest(job_id=str(i), prompt_token_ids=tokens, sampling=params, adapter=adapter))
        torch.cuda.synchronize()
        start_ms = time.time() * 1000
        start = time.perf_counter()
        done = []
        while engine.num_unfinished:
            done += engine.step()
        wall = time.perf_counter() - start
        end_ms = start_ms + wall * 1000
        assert all(r.completion_tokens == new_tokens for r in done), "a request did not run to max_tokens"
        ttft = sum(r.first_token_ms - start_ms for r in done) / len(done) / 1000
        # every request of a batch finishes in the last step: its last token lands at the end
        tpot = sum((end_ms - r.first_token_ms) / 1000 / (new_tokens - 1) for r in done) / len(done)
        return wall, ttft, tpot


def hf_generate(info: ModelInfo, batch: int, prompt: int, new_tokens: int, adapters: int) -> tuple[float, float]:
    """(wall s, tok/s) of transformers `generate` (greedy) on the same shapes; with PEFT and
    `adapter_names` (a mixed batch) when adapters > 0."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=info.hidden_size,
        intermediate_size=info.intermediate_size,
        num_hidden_layers=info.num_layers,
        num_attention_heads=info.num_heads,
        num_key_value_heads=info.num_kv_heads,
        vocab_size=info.vocab_size,
        max_position_embeddings=info.max_context,
        rope_theta=info.rope_theta,
        rms_norm_eps=info.rms_norm_eps,
        torch_dtype="bfloat16",
    )
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # initialise in bf16: an fp32 8B model would not fit beside it
    try:
        with torch.device("cuda"):
            model = LlamaForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(default_dtype)
    kwargs = {}
    if adapters:
        lora = LoraConfig(r=RANK, lora_alpha=32, target_modules=list(PROJECTIONS), init_lora_weights=False)
        model = get_peft_model(model, lora, adapter_name="a0")
        for i in range(1, adapters):
            model.add_adapter(f"a{i}", lora)
        model = model.to(torch.bfloat16).eval()  # PEFT refuses adapter_names in training mode
        kwargs["adapter_names"] = [f"a{i % adapters}" for i in range(batch)]
    input_ids = torch.tensor(prompts(batch, prompt, info.vocab_size), device="cuda")
    generate = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        model.generate(input_ids=input_ids[:, :8], **{**generate, "max_new_tokens": 2, "min_new_tokens": 2})
        torch.cuda.synchronize()
        start = time.perf_counter()
        model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), **generate, **kwargs)
        torch.cuda.synchronize()
    wall = time.perf_counter() - start
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return wall, batch * new_tokens / wall


# torch.profiler kernel names → the kinds a decode step's GPU time is reported in
_KERNEL_KINDS = (
    ("lora", ("_shrink_kernel", "_expand_kernel", "_expand_gather_kernel", "_fused_kernel")),
    ("attention", ("_paged_attention_kernel",)),
    ("fused", ("_rms_norm_kernel", "_silu_and_mul_kernel", "_rope_and_cache_kernel")),
    ("gemm", ("gemm", "nvjet", "cutlass", "sm90_xmma")),
    ("copy", ("memcpy", "memset")),
)


def kernel_kind(name: str) -> str:
    lowered = name.lower()
    return next((kind for kind, marks in _KERNEL_KINDS if any(m in lowered for m in marks)), "other")


def profile_decode(bench: EngineBench, batch: int, prompt: int, adapters: int, steps: int = 10) -> dict[str, float]:
    """Milliseconds per decode step of `batch` sequences of `prompt` tokens: "wall" under the profiler
    and the GPU kernel time by kind (kernels inside graph replays included; kernels that run at once
    on two streams both count, so "gpu" can exceed the wall time)."""
    engine = bench.engine
    prefill_steps = -(-batch * prompt // PREFILL_TOKENS_PER_STEP)
    params = SamplingParams(max_tokens=prefill_steps + steps + 4, temperature=0.0, ignore_eos=True)
    for i, tokens in enumerate(prompts(batch, prompt, bench.info.vocab_size)):
        adapter = bench.refs[i % adapters] if adapters else None
        engine.add(EngineRequest(job_id=str(i), prompt_token_ids=tokens, sampling=params, adapter=adapter))
    for _ in range(prefill_steps + 2):  # prefill chunks, then decode steps warm
        engine.step()
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    times = {"wall": wall * 1e3 / steps}
    for event in prof.key_averages():
        # kernels and copies only: an operator's own row repeats the time of the kernels it launched
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kind = kernel_kind(event.key)
            times[kind] = times.get(kind, 0.0) + event.self_device_time_total / 1e3 / steps
    times["gpu"] = sum(v for k, v in times.items() if k != "wall")
    while engine.num_unfinished:  # the engine is the bench's for its whole run: leave it empty
        engine.step()
    return times


def mixed_step_ms(bench: EngineBench, batch: int, context: int, chunk: int, adapters: int) -> dict[str, float]:
    """Mean ms per step of the runner (host and GPU overlapped, as the engine steps): "decode", B
    decoding sequences alone; "piecewise" and "eager", the same beside one prefill chunk of `chunk`
    tokens (no chunk: only "decode")."""
    runner, block_size = bench.runner, bench.config.block_size
    blocks = BlockManager(runner.num_blocks, block_size)
    tokens = prompts(batch + 1, context + chunk, bench.info.vocab_size)
    decoding = []
    for i in range(batch):
        seq = Sequence(seq_id=str(i), prompt_token_ids=list(tokens[i][:context]), sampling=None, seed=0)
        seq.adapter_uid = bench.refs[i % adapters].uid if adapters else None
        blocks.allocate(seq, context + 1)
        seq.num_computed_tokens = context
        seq.output_token_ids.append(1)
        decoding.append(seq)
    new = Sequence(seq_id="new", prompt_token_ids=list(tokens[batch]), sampling=None, seed=0)
    new.adapter_uid = bench.refs[batch % adapters].uid if adapters else None
    blocks.allocate(new, context + chunk)
    new.num_computed_tokens = context  # a later chunk of a long prompt: attends to what is cached
    decode = [ScheduledSequence(s, 1) for s in decoding]
    mixed = [*decode, ScheduledSequence(new, chunk)]

    slot_of = bench.engine.adapter_slots.slot_of  # the adapters' slots, as the pool loaded them

    def timed(scheduled: list[ScheduledSequence], steps: int = 20) -> float:
        for _ in range(3):
            runner.execute(scheduled, slot_of, block_size)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(steps):
            runner.execute(scheduled, slot_of, block_size)
        torch.cuda.synchronize()
        return (time.perf_counter() - start) * 1e3 / steps

    times = {"decode": timed(decode)}
    if chunk:
        times["piecewise"] = timed(mixed)
        piecewise, runner.piecewise = runner.piecewise, None
        try:
            times["eager"] = timed(mixed)
        finally:
            runner.piecewise = piecewise
    return times


def run_engine_rows(
    bench: EngineBench,
    args: argparse.Namespace,
    adapter_counts: list[int],
    system: str,
    bandwidth: float,
    report: Callable[[Row], None],
) -> None:
    """`report` the grid's rows (every prompt, batch and adapter count of `adapter_counts`) on `bench`'s
    engine as each is measured, every shape first warmed up untimed (Triton compiles and cuBLAS
    handles: a LoRA launch configuration's first use at a new token count stalled that row's TTFT by
    1-2 s on the H200)."""
    for prompt in args.prompts:
        for batch in args.batches:
            bench.run(batch, prompt, 2, max(adapter_counts))
    for prompt in args.prompts:
        for batch in args.batches:
            for adapters in adapter_counts:
                wall, ttft, tpot = bench.run(batch, prompt, args.new_tokens, adapters)
                report(
                    Row(
                        system,
                        batch,
                        prompt,
                        args.new_tokens,
                        adapters,
                        batch * args.new_tokens / wall,
                        ttft * 1e3,
                        tpot * 1e3,
                        batch / tpot,
                        roofline(bench.info, batch, prompt + args.new_tokens / 2, bandwidth),
                    )
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.engine", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    # defaults by mode (parse_args): one GPU's grid, or the tensor-parallel rows' (bench/tensor_parallel.py)
    parser.add_argument("--batches", type=int, nargs="+", help="default: 1 8 32 64 128; with --tensor-parallel 1 32 64")
    parser.add_argument("--prompts", type=int, nargs="+", help="default: 128 1024; with --tensor-parallel 128")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--adapters", type=int, nargs="+", help="default: 0 8 32; with --tensor-parallel 0 8")
    parser.add_argument("--tensor-parallel", type=int, default=1,
                        help="instead, the tensor-parallel rows on this many GPUs: Llama-3-8B at TP 1 and N, "
                        "a 70B shape at TP N (bench/tensor_parallel.py)")  # fmt: skip
    parser.add_argument("--hf-batch", type=int, default=32)
    parser.add_argument("--hf-prompt", type=int, default=128)
    parser.add_argument("--hf-new-tokens", type=int, help="default: --new-tokens, the engine rows' workload")
    parser.add_argument("--hf-adapters", type=int, nargs="*", default=[0, 8])
    parser.add_argument("--profile-batch", type=int, help="profile decode steps of this batch instead")
    parser.add_argument("--mixed-steps", type=int, help="time steps admitting requests beside this many decodes")
    parser.add_argument("--chunks", type=int, nargs="+", default=[64, 256, 1024], help="prefill chunks (--mixed-steps)")
    parser.add_argument("--out", help="write the rows as JSON lines here")
    parser.add_argument("--quantization", nargs="+", choices=("none", "fp8", "int4"), default=["none"],
                        help="engine rows for each weight format (none: bf16)")  # fmt: skip
    parser.add_argument("--kv-cache-dtype", nargs="+", choices=("auto", "fp8"), default=["auto"],
                        help="engine rows for each KV cache dtype")  # fmt: skip
    parser.add_argument("--adapter-dir", help="where the adapters' PEFT files are written, or found from an "
                        "earlier run (default: a new temporary directory)")  # fmt: skip
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, each grid flag not given taking its mode's default."""
    args = build_parser().parse_args(argv)
    one_gpu = {"batches": [1, 8, 32, 64, 128], "prompts": [128, 1024], "adapters": [0, 8, 32]}
    defaults = one_gpu if args.tensor_parallel == 1 else TP_DEFAULTS
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.tensor_parallel > 1:
        from bench.tensor_parallel import run  # imports this module: loaded only when asked for

        run(args)
        return
    variants = [
        served(LLAMA3_8B, weights, kv_cache) for weights in args.quantization for kv_cache in args.kv_cache_dtype
    ]
    info = variants[0]
    root = adapter_dir(args.adapter_dir)
    if args.profile_batch:
        prompt = args.prompts[0]
        bench = EngineBench(info, max(args.adapters), args.profile_batch, prompt + 64, root)
        graphs = bench.runner.graphs
        for adapters in args.adapters:
            for mode in ("graphs", "eager"):
                bench.runner.graphs = graphs if mode == "graphs" else None
                times = profile_decode(bench, args.profile_batch, prompt, adapters)
                cells = "  ".join(f"{kind} {ms:.2f}" for kind, ms in sorted(times.items()))
                label = f"batch {args.profile_batch} prompt {prompt} adapters {adapters} {mode:<6}"
                print(f"{label} ms/step: {cells}", flush=True)
        return
    if args.mixed_steps:
        batch, context = args.mixed_steps, args.prompts[0]
        bench = EngineBench(info, max(args.adapters), batch + 1, context + max(args.chunks) + 1, root)
        print(f"{'batch':>6}{'chunk':>7}{'adapt':>6}{'decode ms':>11}{'piecewise ms':>14}{'eager ms':>10}")
        for adapters in args.adapters:
            decode = mixed_step_ms(bench, batch, context, 0, adapters)["decode"]
            for chunk in args.chunks:
                times = mixed_step_ms(bench, batch, context, chunk, adapters)
                print(f"{batch:>6}{chunk:>7}{adapters:>6}{decode:>11.2f}{times['piecewise']:>14.2f}"
                      f"{times['eager']:>10.2f}", flush=True)  # fmt: skip
        return
    bandwidth = copy_bandwidth()
    print(f"device {torch.cuda.get_device_name()}  copy bandwidth {bandwidth / 1e12:.2f} TB/s", flush=True)
    rows: list[Row] = []

    def report(row: Row) -> None:
        rows.append(row)
        print(json.dumps(asdict(row)), flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(asdict(row)) + "\n")

    for adapters in args.hf_adapters:
        b, p, n = args.hf_batch, args.hf_prompt, args.hf_new_tokens or args.new_tokens
        _, tok_s = hf_generate(LLAMA3_8B, b, p, n, adapters)
        system = "transformers+peft" if adapters else "transformers"
        report(Row(system, b, p, n, adapters, tok_s, 0.0, 0.0, 0.0, roofline(LLAMA3_8B, b, p + n / 2, bandwidth)))

    max_seqs, max_context = max(args.batches), max(args.prompts) + args.new_tokens
    kv_blocks: dict[str, int] = {}
    for variant in variants:
        system = engine_system(variant)
        kv_blocks[system] = planned_kv_blocks(variant)
        print(f"{system}: the memory plan gives {kv_blocks[system]} KV blocks on this GPU", flush=True)
        # one engine at a time: two 8B engines with their KV caches do not fit an 80 GB GPU. The bf16 base
        # rows run again on an engine without LoRA (--max-loras 0), the worker LoRA must not slow down
        configurations = [(system, args.adapters, True)]
        if system == LORAFLEET and 0 in args.adapters:
            configurations.append((NO_LORA, [0], False))
        for name, adapter_counts, lora in configurations:
            bench = EngineBench(variant, max(adapter_counts), max_seqs, max_context, root, lora=lora)
            sizes = bench.runner.graphs.sizes if bench.runner.graphs else []
            print(f"{name} engine ready in {bench.setup_s:.1f} s (KV cache, decode graphs for {sizes})", flush=True)
            run_engine_rows(bench, args, adapter_counts, name, bandwidth, report)
            del bench
            gc.collect()  # the engine's graphs, weights and KV storage go back before the next is built
            torch.cuda.empty_cache()

    print(
        f"\n{'system':<18}{'batch':>6}{'prompt':>7}{'new':>5}{'adapt':>6}{'tok/s':>9}{'TTFT ms':>9}"
        f"{'TPOT ms':>9}{'decode tok/s':>13}{'roofline':>10}{'dec/roof':>9}"
    )
    for r in rows:
        share = r.decode_tok_s / r.roofline_tok_s if r.decode_tok_s else 0.0
        print(
            f"{r.system:<18}{r.batch:>6}{r.prompt:>7}{r.new_tokens:>5}{r.adapters:>6}{r.tok_s:>9.0f}"
            f"{r.ttft_ms:>9.1f}{r.tpot_ms:>9.2f}{r.decode_tok_s:>13.0f}{r.roofline_tok_s:>10.0f}{share:>9.2f}"
        )
    print_lora_off_ratios(rows)
    print_targets(rows, kv_blocks)
    print_int4_targets(rows, LORAFLEET)


def engine_system(info: ModelInfo) -> str:
    """The rows' system name of an engine serving `info`: plain `lorafleet` for bf16 weights and cache."""
    if info.quantization == "none" and info.kv_cache_dtype == "auto":
        return LORAFLEET
    return f"lorafleet {info.quantization}/{info.kv_cache_dtype}"


def served(info: ModelInfo, weights: str, kv_cache: str) -> ModelInfo:
    """`info` served with weights `weights` ("none": bf16, or "fp8") and a `kv_cache` ("auto" or "fp8") cache."""
    quantization = None if weights == "none" else weights
    return info.served(quantization=quantization, kv_cache_dtype=kv_cache, source=Path(info.name))


def planned_kv_blocks(info: ModelInfo) -> int:
    """The KV blocks the worker's memory plan gives `info` on this GPU as it is now (the default
    engine settings, enough sequences that the room, not a full batch, bounds the cache)."""
    config = EngineConfig(device="cuda", dtype="bfloat16", max_num_seqs=1024)
    plan = plan_memory({info.name: info}, config, memory=DeviceMemory.measure(torch.device("cuda")))
    return plan.kv_blocks(info.name)


def print_targets(rows: list[Row], kv_blocks: dict[str, int]) -> None:
    """The quantization targets, each measured figure beside its bound, for the rows this run has."""
    engine = {(r.system, r.batch, r.prompt, r.adapters): r for r in rows if r.system.startswith("lorafleet")}
    fp8 = "lorafleet fp8/auto"
    if not any(system.startswith("lorafleet fp8") for system, *_ in engine):
        return
    print("\ntargets")
    for (system, batch, prompt, adapters), row in sorted(engine.items()):
        if not system.startswith("lorafleet fp8"):
            continue
        share = row.decode_tok_s / row.roofline_tok_s
        print(f"  {system} batch {batch} prompt {prompt} adapters {adapters}: {share:.2f} of its roofline (>= 0.80)")
        bf16 = engine.get((LORAFLEET, batch, prompt, adapters))
        if bf16 is not None and system == fp8 and 8 <= batch <= 32:
            print(f"    decode {row.decode_tok_s / bf16.decode_tok_s:.2f}x bf16 (>= 1.7)")
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


if __name__ == "__main__":
    main()
