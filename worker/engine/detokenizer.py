"""Incremental detokenization and stop strings.

Decoding a window of recent tokens (not the whole output each step) keeps the cost per token
constant; a window that ends in an incomplete UTF-8 sequence (U+FFFD) waits for the next token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenizers import Tokenizer


@dataclass(slots=True)
class IncrementalDetokenizer:
    tokenizer: Tokenizer
    stop: tuple[str, ...]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    _prefix_offset: int = 0
    _read_offset: int = 0

    def append(self, token_id: int) -> bool:
        """Add one generated token; returns True when the text now contains a stop string
        (the text is then cut just before it)."""
        self.token_ids.append(token_id)
        window = self.token_ids[self._prefix_offset :]
        prefix = self.tokenizer.decode(self.token_ids[self._prefix_offset : self._read_offset])
        full = self.tokenizer.decode(window)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return False
        delta = full[len(prefix) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self.token_ids)
        return self._append_text(delta)

    def _append_text(self, delta: str) -> bool:
        search_from = max(0, len(self.text) - max((len(s) for s in self.stop), default=0) + 1)
        self.text += delta
        hits = [i for i in (self.text.find(s, search_from) for s in self.stop) if i >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            return True
        return False
