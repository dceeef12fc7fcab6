"""bench.engine's measurements: an engine over random weights run batch by batch (EngineBench), the
transformers(+PEFT) baseline on the same workload, decode steps profiled by kernel kind, the runner's
mixed prefill/decode steps, and the KV blocks the memory plan gives."""

from __future__ import annotations

import argparse
import gc
import time
from collections.abc import Callable
from pathlib import Path

import torch

from bench.engine_report import Row
from bench.random_adapters import adapter_name, load_adapters, write_adapter
from bench.random_engine import PREFILL_TOKENS_PER_STEP, RANK, engine_config, prompts, random_engine
from bench.roofline import roofline
from shared.config import EngineConfig
from shared.model_info import PROJECTIONS, ModelInfo
from shared.schema import AdapterRef, SamplingParams
from worker.engine.block_manager import BlockManager
from worker.engine.engine_request import EngineRequest
from worker.engine.scheduler import ScheduledSequence
from worker.engine.sequence import Sequence
from worker.memory_plan import DeviceMemory, plan_memory
from worker.tensor_parallel import Followers


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


# torch.profiler kernel names → the kinds a step's GPU time is reported in (first match wins)
_KERNEL_KINDS = (
    ("lora shrink", ("_shrink_kernel",)),
    ("lora expand", ("_expand_kernel", "_expand_gather_kernel", "_fused_kernel")),
    ("lora metadata", ("_build_kernel",)),
    ("attention", ("_paged_attention_kernel", "flash", "attention")),
    ("fused", ("_rms_norm_kernel", "_silu_and_mul_kernel", "_rope_and_cache_kernel")),
    ("gemm", ("gemm", "nvjet", "cutlass", "sm90_xmma")),
    ("copy", ("memcpy", "memset")),
)


def kernel_kind(name: str) -> str:
    lowered = name.lower()
    return next((kind for kind, marks in _KERNEL_KINDS if any(m in lowered for m in marks)), "other")


def kernel_ms(step: Callable[[], None], steps: int) -> dict[str, float]:
    """Milliseconds per call of `step`: "wall" under the profiler, and the GPU kernel time by kind
    (kernels inside graph replays included; kernels that run at once on two streams both count, so
    "gpu", their sum, can exceed the wall time)."""
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    times = {"wall": wall * 1e3 / steps}
    for event in prof.key_averages():
        # kernels and copies only: an operator's own row repeats the time of the kernels it launched
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kind = kernel_kind(event.key)
            times[kind] = times.get(kind, 0.0) + event.self_device_time_total / 1e3 / steps
    times["gpu"] = sum(v for k, v in times.items() if k != "wall")
    return times


def profile_decode(bench: EngineBench, batch: int, prompt: int, adapters: int, steps: int = 10) -> dict[str, float]:
    """kernel_ms of one decode step of `batch` sequences of `prompt` tokens."""
    engine = bench.engine
    prefill_steps = -(-batch * prompt // PREFILL_TOKENS_PER_STEP)
    params = SamplingParams(max_tokens=prefill_steps + steps + 4, temperature=0.0, ignore_eos=True)
    for i, tokens in enumerate(prompts(batch, prompt, bench.info.vocab_size)):
        adapter = bench.refs[i % adapters] if adapters else None
        engine.add(EngineRequest(job_id=str(i), prompt_token_ids=tokens, sampling=params, adapter=adapter))
    for _ in range(prefill_steps + 2):  # prefill chunks, then decode steps warm
        engine.step()
    times = kernel_ms(engine.step, steps)
    while engine.num_unfinished:  # the engine is the bench's for its whole run: leave it empty
        engine.step()
    return times


def mixed_step_ms(
    bench: EngineBench, batch: int, context: int, chunk: int, adapters: int
) -> tuple[dict[str, float], dict[str, float]]:
    """Mean ms per step of the runner (host and GPU overlapped, as the engine steps): "decode", B
    decoding sequences alone; "piecewise" and "eager", the same beside one prefill chunk of `chunk`
    tokens (no chunk: only "decode"). Second: the piecewise mixed step's kernel_ms (the decode
    step's without a chunk), where its GPU time goes."""
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
    if not chunk:
        return times, kernel_ms(lambda: runner.execute(decode, slot_of, block_size), 10)
    times["piecewise"] = timed(mixed)
    split = kernel_ms(lambda: runner.execute(mixed, slot_of, block_size), 10)
    piecewise, runner.piecewise = runner.piecewise, None
    try:
        times["eager"] = timed(mixed)
    finally:
        runner.piecewise = piecewise
    return times, split


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


def planned_kv_blocks(info: ModelInfo) -> int:
    """The KV blocks the worker's memory plan gives `info` on this GPU as it is now (the default
    engine settings, enough sequences that the room, not a full batch, bounds the cache)."""
    config = EngineConfig(device="cuda", dtype="bfloat16", max_num_seqs=1024)
    plan = plan_memory({info.name: info}, config, memory=DeviceMemory.measure(torch.device("cuda")))
    return plan.kv_blocks(info.name)
