"""gateway/tokenization.py: the short prompts of one event-loop turn are encoded in one call."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from tokenizers import Tokenizer

from gateway.tokenization import TurnBatchEncoder
from tests.gateway.fleet import build_tokenizer


class CountedCalls:
    """A tokenizer that records each batch it is given and refuses to encode `bad`."""

    def __init__(self, tokenizer: Tokenizer, bad: str = "") -> None:
        self._tokenizer = tokenizer
        self._bad = bad
        self.batches: list[tuple[list[str], bool]] = []

    def encode_batch_fast(self, texts: list[str], add_special_tokens: bool = True) -> list[Any]:
        self.batches.append((texts, add_special_tokens))
        if self._bad in texts:
            raise ValueError(f"cannot encode {self._bad!r}")
        return self._tokenizer.encode_batch_fast(texts, add_special_tokens=add_special_tokens)


TEXTS = ["hello world", "the quick brown fox", "hello"]


async def test_one_turns_texts_are_encoded_in_one_call_each_getting_its_own_ids() -> None:
    tokenizer = build_tokenizer()
    counted = CountedCalls(tokenizer)
    encoder = TurnBatchEncoder(counted)  # type: ignore[arg-type]

    ids = await asyncio.gather(*(encoder.encode(text, True) for text in TEXTS))
    later = await encoder.encode("world", True)

    assert ids == [tokenizer.encode(text).ids for text in TEXTS]
    assert later == tokenizer.encode("world").ids
    assert counted.batches == [(TEXTS, True), (["world"], True)]


async def test_texts_with_and_without_special_tokens_go_in_separate_calls() -> None:
    tokenizer = build_tokenizer()
    counted = CountedCalls(tokenizer)
    encoder = TurnBatchEncoder(counted)  # type: ignore[arg-type]

    with_bos, without = await asyncio.gather(encoder.encode("hello", True), encoder.encode("hello", False))

    assert with_bos == tokenizer.encode("hello").ids
    assert without == tokenizer.encode("hello", add_special_tokens=False).ids
    assert sorted(counted.batches) == [(["hello"], False), (["hello"], True)]


async def test_a_text_that_fails_to_encode_fails_only_its_own_request() -> None:
    tokenizer = build_tokenizer()
    encoder = TurnBatchEncoder(CountedCalls(tokenizer, bad="fox"))  # type: ignore[arg-type]

    hello, fox = await asyncio.gather(
        encoder.encode("hello", True), encoder.encode("fox", True), return_exceptions=True
    )

    assert hello == tokenizer.encode("hello").ids
    assert isinstance(fox, ValueError)


async def test_a_request_that_went_away_leaves_the_others_answered() -> None:
    tokenizer = build_tokenizer()
    encoder = TurnBatchEncoder(CountedCalls(tokenizer))  # type: ignore[arg-type]

    gone = encoder.encode("hello", True)
    kept = encoder.encode("world", True)
    gone.cancel()

    assert await kept == tokenizer.encode("world").ids
    with pytest.raises(asyncio.CancelledError):
        await gone
