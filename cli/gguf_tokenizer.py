"""A GGUF file's tokenizer as Hugging Face files: tokenizer.json (for the `tokenizers` library) and
tokenizer_config.json (special tokens and the chat template, as the gateway reads them).

Only what the demo model needs: a GPT-2-style byte-level BPE (`tokenizer.ggml.model == "gpt2"`)
with SmolLM's pre-tokenizer, which splits every digit into its own word before the byte-level
regex, as llama.cpp's `smollm` pre-tokenizer and SmolLM2's own tokenizer.json do.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gguf import GGUFReader
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

# llama.cpp's token types (gguf.TokenType): CONTROL tokens are the special ones (<|im_start|>, ...)
_CONTROL = 3
_PRE_TOKENIZERS = {
    "smollm": lambda: pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    ),
}


class UnsupportedTokenizer(ValueError):
    pass


def _field(reader: GGUFReader, name: str, default: Any = None) -> Any:
    field = reader.fields.get(name)
    return default if field is None else field.contents()


def build_tokenizer(reader: GGUFReader) -> Tokenizer:
    """The `tokenizers` BPE the GGUF's metadata describes; ids are the GGUF's token indices."""
    kind, pre = _field(reader, "tokenizer.ggml.model"), _field(reader, "tokenizer.ggml.pre")
    if kind != "gpt2" or pre not in _PRE_TOKENIZERS:
        raise UnsupportedTokenizer(f"tokenizer {kind!r} with pre-tokenizer {pre!r} (supported: gpt2 with smollm)")
    tokens: list[str] = _field(reader, "tokenizer.ggml.tokens")
    token_types: list[int] = _field(reader, "tokenizer.ggml.token_type")
    merges = [tuple(merge.split(" ", 1)) for merge in _field(reader, "tokenizer.ggml.merges")]
    vocab = {token: index for index, token in enumerate(tokens)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tokenizer.pre_tokenizer = _PRE_TOKENIZERS[pre]()
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    # control tokens are matched whole before BPE, and skipped by decode(skip_special_tokens=True)
    control = [token for token, kind in zip(tokens, token_types, strict=True) if kind == _CONTROL]
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in control])
    return tokenizer


def tokenizer_config(reader: GGUFReader) -> dict[str, Any]:
    """tokenizer_config.json: the special tokens by name and the chat template."""
    tokens: list[str] = _field(reader, "tokenizer.ggml.tokens")

    def token(field: str) -> str | None:
        index = _field(reader, f"tokenizer.ggml.{field}_token_id")
        return None if index is None else tokens[index]

    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("bos"),
        "eos_token": token("eos"),
        "unk_token": token("unknown"),
        "pad_token": token("padding"),
        "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(_field(reader, f"{_field(reader, 'general.architecture')}.context_length")),
        "chat_template": _field(reader, "tokenizer.chat_template"),
    }


def write_tokenizer(reader: GGUFReader, model_dir: Path) -> None:
    build_tokenizer(reader).save(str(model_dir / "tokenizer.json"))
    (model_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(reader), indent=2) + "\n")
