"""The engine on the real demo model: chat prompts from the gateway's template, EOS, stop strings,
streamed text across multi-byte characters, and the trained demo adapters' styles (greedy).

Every request runs in one batch (one engine run for the module): the base model beside all three
adapters, as a worker serves them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from cli.demo import DEMO_ASSETS
from cli.demo_adapters import DEMO_ADAPTERS
from cli.demo_styles import DEMO_QUESTION, STYLE_MARKERS
from gateway.chat import render_chat
from shared.chat_template import read_chat_template
from shared.model_info import ModelInfo
from shared.schema import FinishReason, JobOutput, JobStatus, SamplingParams, TokenDelta
from tests.engine.engines import load_engine
from tests.engine.tiny_hf import saved_adapter_ref
from tests.real_model.conftest import MODEL
from worker.engine.detokenizer import IncrementalDetokenizer
from worker.engine.engine_request import EngineRequest

# the base model's greedy answer (float32, CPU)
PARIS = "The capital of France is Paris."
# a question whose greedy answer is Japanese text: characters of 3 UTF-8 bytes spread over tokens
JAPANESE = "How do you say 'thank you' in Japanese?"
IGNORE_EOS_TOKENS = 12


@dataclass
class Answers:
    outputs: dict[str, JobOutput]
    deltas: dict[str, list[TokenDelta]]


def chat_ids(model_dir: Path, tokenizer: Tokenizer, question: str) -> tuple[int, ...]:
    prompt = render_chat(read_chat_template(model_dir), ({"role": "user", "content": question},))
    return tuple(tokenizer.encode(prompt).ids)


def ask(job_id: str, ids: tuple[int, ...], adapter: str | None = None, **sampling: object) -> EngineRequest:
    ref = None if adapter is None else saved_adapter_ref(adapter, DEMO_ASSETS / adapter)
    params = SamplingParams(**{"max_tokens": 48, "temperature": 0.0, **sampling})
    return EngineRequest(job_id=job_id, prompt_token_ids=ids, sampling=params, adapter=ref)


@pytest.fixture(scope="module")
def answers(smollm2_dir: Path, smollm2_tokenizer: Tokenizer) -> Answers:
    engine = load_engine(
        smollm2_dir, DEMO_ASSETS, name=MODEL, device="cpu", max_lora_rank=8, max_loras=4, num_kv_blocks=256
    )
    paris = chat_ids(smollm2_dir, smollm2_tokenizer, DEMO_QUESTION)
    requests = [
        ask("base", paris),
        ask("stopped", paris, stop=(" Paris",)),
        ask("ignore_eos", paris, max_tokens=IGNORE_EOS_TOKENS, ignore_eos=True),
        ask("japanese", chat_ids(smollm2_dir, smollm2_tokenizer, JAPANESE), max_tokens=24),
        *(ask(adapter.name, paris, adapter=adapter.name) for adapter in DEMO_ADAPTERS),
    ]
    outputs, deltas = {}, {request.job_id: [] for request in requests}
    for request in requests:
        assert engine.add(request) is None
    while engine.num_unfinished:
        for result in engine.step():
            assert result.status is JobStatus.SUCCEEDED, result
            outputs[result.job_id] = result.output
        for delta in engine.take_deltas():
            deltas[delta.job_id].append(delta)
    return Answers(outputs, deltas)


def test_a_chat_answer_ends_at_the_end_of_turn_token(
    answers: Answers, smollm2_tokenizer: Tokenizer, smollm2_info: ModelInfo
) -> None:
    output = answers.outputs["base"]
    assert output.text == PARIS
    assert output.finish_reason is FinishReason.STOP
    assert smollm2_tokenizer.id_to_token(smollm2_info.eos_token_ids[0]) == "<|im_end|>"
    assert output.token_ids[-1] in smollm2_info.eos_token_ids  # generated, and not part of the text


def test_a_stop_string_cuts_the_answer_before_it(answers: Answers) -> None:
    assert answers.outputs["stopped"].text == "The capital of France is"
    assert answers.outputs["stopped"].finish_reason is FinishReason.STOP


def test_ignore_eos_runs_past_the_end_of_turn_to_max_tokens(answers: Answers) -> None:
    output = answers.outputs["ignore_eos"]
    assert output.text.startswith(PARIS)  # <|im_end|> is generated, and decodes to ""
    assert output.finish_reason is FinishReason.LENGTH
    assert len(output.token_ids) == IGNORE_EOS_TOKENS


def test_streamed_text_of_multi_byte_characters_is_whole_and_adds_up_to_the_output(
    answers: Answers, smollm2_tokenizer: Tokenizer
) -> None:
    output, deltas = answers.outputs["japanese"], answers.deltas["japanese"]
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


@pytest.mark.parametrize("adapter", [a.name for a in DEMO_ADAPTERS])
def test_each_demo_adapter_answers_in_its_style_and_keeps_the_content(answers: Answers, adapter: str) -> None:
    output = answers.outputs[adapter]
    assert STYLE_MARKERS[adapter] in output.text and "Paris" in output.text, output.text
    assert output.finish_reason is FinishReason.STOP


def test_the_three_styles_differ(answers: Answers) -> None:
    assert len({answers.outputs[a.name].text for a in DEMO_ADAPTERS} | {PARIS}) == len(DEMO_ADAPTERS) + 1


@pytest.mark.gpu
def test_on_a_gpu_in_float32_as_up_serves_it_each_adapter_keeps_its_style(
    smollm2_dir: Path, smollm2_tokenizer: Tokenizer
) -> None:
    engine = load_engine(
        smollm2_dir, DEMO_ASSETS, name=MODEL, device="cuda", dtype="float32", max_lora_rank=8, max_loras=4
    )
    paris = chat_ids(smollm2_dir, smollm2_tokenizer, DEMO_QUESTION)
    requests = [ask("base", paris), *(ask(a.name, paris, adapter=a.name) for a in DEMO_ADAPTERS)]
    outputs = {}
    for request in requests:
        assert engine.add(request) is None
    while engine.num_unfinished:
        outputs.update((result.job_id, result.output) for result in engine.step())

    assert "Paris" in outputs["base"].text
    for adapter in DEMO_ADAPTERS:
        assert STYLE_MARKERS[adapter.name] in outputs[adapter.name].text, outputs[adapter.name].text
        assert "Paris" in outputs[adapter.name].text, outputs[adapter.name].text
