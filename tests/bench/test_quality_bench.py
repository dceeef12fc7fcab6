"""bench.quality's perplexity, on a tiny checkpoint loaded the way the bench loads the demo model (the
worker's loader, the adapter through the pool's reader and slot writer), against transformers + PEFT:
unquantized, and with 4-bit weights quantized at load in the fallback group (the tiny model's
intermediate width 96 is not whole groups of 128 or 64: groups of 32) against the dequantized oracle.
Both chunkings (one prefill per window, and chunks of W8A16_MAX_TOKENS) score the same tokens."""

from __future__ import annotations

import math

import pytest
import torch
from peft import PeftModel

from bench.quality import ADAPTER_SLOT, BLOCK_SIZE, load, perplexity
from kernels.quant import W8A16_MAX_TOKENS
from shared.config import EngineConfig
from tests.engine.int4_oracle import int4_oracle
from tests.engine.tiny_hf import TinyCheckpoint, build_checkpoint, oracle_logits
from worker.model.kv_cache import KVCache, KVLayout

WINDOW = 80  # more than one W8A16_MAX_TOKENS chunk
ADAPTER = "all_r8"
# both sides compute in float32 from the same (dequantized) weights: they differ by reassociation
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> TinyCheckpoint:
    return build_checkpoint("llama", tmp_path_factory.mktemp("quality_llama"))


def oracle_perplexity(oracle: PeftModel, ids: list[int], window: int, adapter: str | None) -> float:
    """exp(mean negative log-likelihood) of every window's tokens after its first, by HF."""
    nll, count = 0.0, 0
    for start in range(0, len(ids) - window + 1, window):
        chunk = ids[start : start + window]
        log_probs = torch.log_softmax(oracle_logits(oracle, chunk, adapter)[:-1], dim=-1)
        nll -= float(log_probs.gather(1, torch.tensor(chunk[1:])[:, None]).sum())
        count += window - 1
    return math.exp(nll / count)


@pytest.mark.parametrize("quantization", [None, "int4"])
def test_the_bench_perplexity_matches_transformers_and_peft(llama: TinyCheckpoint, quantization: str | None):
    config = EngineConfig(device="cpu", dtype="float32", quantization=quantization, kv_cache_dtype="auto",
                          max_loras=1, max_lora_rank=16)  # fmt: skip
    model = load(llama.model_dir, llama.adapters[ADAPTER], config)
    oracle = llama.oracle
    if quantization == "int4":
        assert model.info.weight_group_size == 32
        oracle = int4_oracle(oracle, group_size=32)
    kv_cache = KVCache.allocate(KVLayout.of(model.info, BLOCK_SIZE, model.dtype), -(-WINDOW // BLOCK_SIZE),
                                torch.device("cpu"))  # fmt: skip
    ids = torch.randint(0, llama.info.vocab_size, (2 * WINDOW,), generator=torch.Generator().manual_seed(0)).tolist()
    for slot, adapter in ((-1, None), (ADAPTER_SLOT, ADAPTER)):
        expected = oracle_perplexity(oracle, ids, WINDOW, adapter)
        with torch.inference_mode():
            for chunk in (WINDOW, W8A16_MAX_TOKENS):
                assert perplexity(model, kv_cache, ids, WINDOW, chunk, slot) == pytest.approx(expected, rel=TOLERANCE)
