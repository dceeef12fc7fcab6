"""The engine on the real demo model: chat prompts from the gateway's template, EOS, stop strings,
streamed text across multi-byte characters, and the trained demo adapters' styles (greedy)."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer

from cli.demo import DEMO_ASSETS
from cli.demo_adapters import DEMO_ADAPTERS
from cli.demo_styles import DEMO_QUESTION, STYLE_MARKERS
from gateway.chat import render_chat
from shared.chat_template import read_chat_template
from shared.config import EngineConfig, ModelSpec
from shared.model_info import ModelInfo
from shared.schema import FinishReason, JobStatus, SamplingParams
from tests.engine.tiny_hf import saved_adapter_ref
from tests.real_model.conftest import MODEL
from worker.engine.detokenizer import IncrementalDetokenizer
from worker.engine.engine import EngineRequest, EngineResult, LLMEngine
from worker.engine.model_runner import ModelRunner

# greedy answers of the base model (float32, CPU), as transformers gives them too
PARIS = "The capital of France is Paris."
# a question whose greedy answer is Japanese text: characters of 3 UTF-8 bytes spread over tokens
JAPANESE = "How do you say 'thank you' in Japanese?"


@pytest.fixture(scope="module")
def engine(smollm2_dir: Path, smollm2_tokenizer: Tokenizer) -> LLMEngine:
    config = EngineConfig(device="cpu", max_lora_rank=8, max_loras=4, num_kv_blocks=256, block_size=16)
    runner = ModelRunner(ModelSpec(MODEL, smollm2_dir), config)
    return LLMEngine(runner, smollm2_tokenizer, config, DEMO_ASSETS)


def chat_ids(model_dir: Path, tokenizer: Tokenizer, question: str) -> tuple[int, ...]:
    prompt = render_chat(read_chat_template(model_dir), ({"role": "user", "content": question},))
    return tuple(tokenizer.encode(prompt).ids)


def run(engine: LLMEngine, requests: list[EngineRequest]) -> tuple[dict[str, EngineResult], list]:
    results, deltas = {}, []
    for request in requests:
        assert engine.add(request) is None
    while engine.num_unfinished:
        results.update((result.job_id, result) for result in engine.step())
        deltas += engine.take_deltas()
    return results, deltas


def ask(job_id: str, ids: tuple[int, ...], adapter: str | None = None, **sampling: object) -> EngineRequest:
    ref = None if adapter is None else saved_adapter_ref(adapter, DEMO_ASSETS / adapter)
    params = SamplingParams(**{"max_tokens": 48, "temperature": 0.0, **sampling})
    return EngineRequest(job_id=job_id, prompt_token_ids=ids, sampling=params, adapter=ref)


def test_a_chat_answer_ends_at_the_end_of_turn_token(
    engine: LLMEngine, smollm2_dir: Path, smollm2_tokenizer: Tokenizer, smollm2_info: ModelInfo
) -> None:
    results, _ = run(engine, [ask("paris", chat_ids(smollm2_dir, smollm2_tokenizer, DEMO_QUESTION))])

    output = results["paris"].output
    assert results["paris"].status is JobStatus.SUCCEEDED
    assert output.text == PARIS
    assert output.finish_reason is FinishReason.STOP
    assert smollm2_tokenizer.id_to_token(smollm2_info.eos_token_ids[0]) == "<|im_end|>"
    assert output.token_ids[-1] in smollm2_info.eos_token_ids  # generated, and not part of the text


def test_a_stop_string_cuts_the_answer_before_it(
    engine: LLMEngine, smollm2_dir: Path, smollm2_tokenizer: Tokenizer
) -> None:
    ids = chat_ids(smollm2_dir, smollm2_tokenizer, DEMO_QUESTION)
    requests = [ask("stopped", ids, stop=(" Paris",)), ask("ignored", ids, max_tokens=12, ignore_eos=True)]
    results, _ = run(engine, requests)

    assert results["stopped"].output.text == "The capital of France is"
    assert results["stopped"].output.finish_reason is FinishReason.STOP
    assert results["ignored"].output.text.startswith(PARIS)  # runs on past <|im_end|>, which decodes to ""
    assert results["ignored"].output.finish_reason is FinishReason.LENGTH
    assert len(results["ignored"].output.token_ids) == 12


def test_streamed_text_of_multi_byte_characters_is_whole_and_adds_up_to_the_output(
    engine: LLMEngine, smollm2_dir: Path, smollm2_tokenizer: Tokenizer
) -> None:
    results, deltas = run(engine, [ask("ja", chat_ids(smollm2_dir, smollm2_tokenizer, JAPANESE), max_tokens=24)])

    output = results["ja"].output
    split_characters = [t for t in output.token_ids if "\ufffd" in smollm2_tokenizer.decode([t])]
    assert split_characters, "the answer has no character whose bytes span tokens: the test tests nothing"
    assert any(ord(c) > 0x3000 for c in output.text)
    assert all("\ufffd" not in delta.text for delta in deltas)
    streamed = "".join(delta.text for delta in deltas)
    assert output.text.startswith(streamed) and "\ufffd" not in output.text
    assert [delta.offset for delta in deltas] == [sum(len(d.text) for d in deltas[:i]) for i in range(len(deltas))]


@pytest.mark.parametrize("text", ["日本語 🙂 café", "👨‍👩‍👧 naïve — “ok”"])
def test_detokenizing_token_by_token_never_shows_half_a_character(smollm2_tokenizer: Tokenizer, text: str) -> None:
    detokenizer = IncrementalDetokenizer(smollm2_tokenizer, stop=())
    seen = []
    for token_id in smollm2_tokenizer.encode(text).ids:
        detokenizer.append(token_id)
        seen.append(detokenizer.text)
    assert detokenizer.text == text
    assert all(text.startswith(prefix) and "\ufffd" not in prefix for prefix in seen)


def test_each_demo_adapter_answers_in_its_style_and_keeps_the_content(
    engine: LLMEngine, smollm2_dir: Path, smollm2_tokenizer: Tokenizer
) -> None:
    ids = chat_ids(smollm2_dir, smollm2_tokenizer, DEMO_QUESTION)
    requests = [ask("base", ids)] + [ask(a.name, ids, adapter=a.name) for a in DEMO_ADAPTERS]
    results, _ = run(engine, requests)  # one batch: every adapter and the base model together

    assert results["base"].output.text == PARIS
    for adapter in DEMO_ADAPTERS:
        text = results[adapter.name].output.text
        assert STYLE_MARKERS[adapter.name] in text and "Paris" in text, (adapter.name, text)
        assert results[adapter.name].output.finish_reason is FinishReason.STOP
    assert len({results[a.name].output.text for a in DEMO_ADAPTERS}) == len(DEMO_ADAPTERS)
