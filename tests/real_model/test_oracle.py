"""The engine's logits on the real demo model, with a trained demo adapter, against transformers + PEFT
(float32): a chat prompt prefilled for the base model and the adapter in one batch, then greedy decode
steps through the paged cache."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from peft import PeftModel
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM

from cli.demo import DEMO_ASSETS
from cli.demo_styles import DEMO_QUESTION
from gateway.chat import render_chat
from shared.chat_template import read_chat_template
from shared.model_info import ModelInfo
from tests.engine.engine_driver import BlockPool, PagedSequence, build_step, make_kv_cache, prefill
from tests.engine.engines import load_model
from tests.engine.tiny_hf import oracle_logits

ADAPTER = "globex-pirate"
SLOT = 1
# float32 through 30 layers, logits of magnitude ~30: the two sum in different orders (measured: <= 7e-5)
TOLERANCE = 5e-4
DECODE_STEPS = 3


@pytest.fixture(scope="module")
def oracle(smollm2_dir: Path) -> PeftModel:
    base = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    return PeftModel.from_pretrained(base, DEMO_ASSETS / ADAPTER, adapter_name=ADAPTER).eval()


def test_prefill_and_decode_match_transformers_and_peft(
    smollm2_dir: Path, smollm2_info: ModelInfo, smollm2_tokenizer: Tokenizer, oracle: PeftModel
) -> None:
    prompt = render_chat(read_chat_template(smollm2_dir), ({"role": "user", "content": DEMO_QUESTION},))
    ids = smollm2_tokenizer.encode(prompt).ids
    model = load_model(smollm2_dir, smollm2_info, {SLOT: DEMO_ASSETS / ADAPTER}, max_lora_rank=8)
    kv_cache = make_kv_cache(model, num_blocks=32, block_size=16)
    pool = BlockPool(32)
    seqs = {None: PagedSequence(list(ids)), ADAPTER: PagedSequence(list(ids), slot=SLOT)}

    logits = prefill(list(seqs.values()), model, kv_cache, pool)
    for step in range(DECODE_STEPS + 1):
        for row, (adapter, seq) in enumerate(seqs.items()):
            expected = oracle_logits(oracle, seq.token_ids, adapter)[-1]
            assert (logits[row] - expected).abs().max() <= TOLERANCE, (step, adapter)
            seq.token_ids.append(int(expected.argmax()))
        if step < DECODE_STEPS:
            logits = model(build_step([(seq, 1) for seq in seqs.values()], model, kv_cache, pool), kv_cache)

    base_reply, styled_reply = (smollm2_tokenizer.decode(seq.token_ids[len(ids) :]) for seq in seqs.values())
    assert base_reply != styled_reply  # the adapter changes the answer from its first tokens
