"""Per-model tokenizers for counting and encoding prompts, loaded once from the model registry.

Parsing a tokenizer.json and encoding a long prompt are CPU work (tens of milliseconds for a
Llama-3-sized vocabulary), so both run on the executor the app owns, never on the event loop. A
short prompt (up to INLINE_CHARS) is encoded on the loop: that takes tens of microseconds, less
than handing it to a thread and back (bench/gateway.py).

The short prompts a model's tokenizer is asked for in one event-loop turn are encoded together, in
one call at the end of the turn (gateway/turn_batch.py): alone between two requests' other work, an
encode finds its tokenizer's tables out of the CPU caches and costs several times its time in a loop
of encodes (docs/benchmarks.md, "Figures behind code comments"); a batch pays that once.

A tokenizer is kept for the life of the process: republishing a model with a different
tokenizer needs a gateway restart.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from concurrent.futures import Executor

from redis.asyncio import Redis
from tokenizers import Tokenizer

from gateway.turn_batch import Batch, TurnBatch, settle
from shared.errors import ErrorCode, LorafleetError
from shared.model_registry import get_tokenizer_json

INLINE_CHARS = 1024


class TokenizerCache:
    """model name → `tokenizers.Tokenizer`, filled on first use."""

    def __init__(self, redis: Redis, executor: Executor) -> None:
        self._redis = redis
        self._executor = executor
        self._tokenizers: dict[str, TurnBatchEncoder] = {}
        self._loading = asyncio.Lock()  # one load at a time, so concurrent first requests parse it once

    def encode(self, model: str, text: str, *, add_special_tokens: bool = True) -> Awaitable[list[int]]:
        """Token ids of `text`, with the model's special tokens (e.g. BOS) added as its post-processor says
        unless `add_special_tokens` is False (a rendered chat template writes its own). A short text for a
        loaded tokenizer gets the turn's batch future itself: no coroutine between it and the caller, which
        would be one more frame to create and to resume per prompt."""
        batches = self._tokenizers.get(model)
        if batches is not None and len(text) <= INLINE_CHARS:
            return batches.encode(text, add_special_tokens)
        return self._load_and_encode(model, text, add_special_tokens)

    async def _load_and_encode(self, model: str, text: str, add_special_tokens: bool) -> list[int]:
        """`encode` for a tokenizer not loaded yet (loaded here), or a long text (encoded on the executor)."""
        batches = self._tokenizers.get(model) or await self._load(model)
        if len(text) <= INLINE_CHARS:
            return await batches.encode(text, add_special_tokens)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, _token_ids, batches.tokenizer, text, add_special_tokens)

    async def _load(self, model: str) -> TurnBatchEncoder:
        async with self._loading:
            batches = self._tokenizers.get(model)
            if batches is None:
                raw = await get_tokenizer_json(self._redis, model)
                if raw is None:
                    raise LorafleetError(ErrorCode.MODEL_NOT_FOUND, f"model {model!r} not found")
                loop = asyncio.get_running_loop()
                tokenizer = await loop.run_in_executor(self._executor, Tokenizer.from_str, raw.decode())
                batches = self._tokenizers[model] = TurnBatchEncoder(tokenizer)
        return batches


class TurnBatchEncoder:
    """One tokenizer's short texts of the current event-loop turn, encoded in one call at its end (one
    call per value of add_special_tokens). A text that fails to encode fails its own request only."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._texts: dict[bool, TurnBatch[str, list[int]]] = {
            add_special_tokens: TurnBatch(lambda batch, add=add_special_tokens: self._flush(batch, add))
            for add_special_tokens in (True, False)
        }

    def encode(self, text: str, add_special_tokens: bool) -> asyncio.Future[list[int]]:
        return self._texts[add_special_tokens].add(text)

    def _flush(self, batch: Batch[str, list[int]], add_special_tokens: bool) -> None:
        texts = [text for text, _ in batch]
        try:
            encodings = self.tokenizer.encode_batch_fast(texts, add_special_tokens=add_special_tokens)
            results: list[list[int] | Exception] = [encoding.ids for encoding in encodings]
        except Exception:  # one of them: each again on its own, so only that one fails
            results = [_token_ids_or_error(self.tokenizer, text, add_special_tokens) for text in texts]
        settle(batch, results)


def _token_ids(tokenizer: Tokenizer, text: str, add_special_tokens: bool) -> list[int]:
    """`tokenizer.encode(text).ids`, without the character offsets `encode` also works out: the batch
    call's fast path skips them."""
    return tokenizer.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids


def _token_ids_or_error(tokenizer: Tokenizer, text: str, add_special_tokens: bool) -> list[int] | Exception:
    try:
        return _token_ids(tokenizer, text, add_special_tokens)
    except Exception as exc:
        return exc
