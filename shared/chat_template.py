"""A model's chat template, as its `tokenizer_config.json` gives it: the Jinja source plus the special
tokens templates refer to (`bos_token`, `eos_token`). Workers publish it beside the tokenizer; the
gateway renders it (gateway/chat.py). Parsing only: no jinja2 here."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

TOKENIZER_CONFIG = "tokenizer_config.json"


@dataclass(frozen=True, slots=True)
class ChatTemplate:
    source: str  # Jinja
    bos_token: str = ""
    eos_token: str = ""

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, raw: str | bytes) -> ChatTemplate:
        return cls(**json.loads(raw))


def _token_text(value: Any) -> str:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else ""


def read_chat_template(model_dir: Path) -> ChatTemplate | None:
    """The default chat template in `model_dir/tokenizer_config.json`, or None when there is none.

    `chat_template` is either one template or a list of named ones (then the one named "default").
    """
    path = Path(model_dir) / TOKENIZER_CONFIG
    if not path.is_file():
        return None
    config = json.loads(path.read_text())
    source = config.get("chat_template")
    if isinstance(source, list):
        source = next((t.get("template") for t in source if isinstance(t, dict) and t.get("name") == "default"), None)
    if not isinstance(source, str) or not source:
        return None
    return ChatTemplate(source, _token_text(config.get("bos_token")), _token_text(config.get("eos_token")))
