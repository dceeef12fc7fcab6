"""A corpus of hostile adapters for one tenant ("acme") of an adapter root, each with the error code
it must be refused with: forged safetensors headers, hostile configs, symlinks and special files at
every level, and path tricks. Each case builds its files in a `Lab` and returns the path a client
would send. Used against shared/adapter_format directly, the gateway's routes and the worker's load."""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from shared.model_info import ModelInfo

OWNER, OTHER = "acme", "globex"
PREFIX = "base_model.model.model.layers.0.self_attn.q_proj"
A, B = f"{PREFIX}.lora_A.weight", f"{PREFIX}.lora_B.weight"
RANK = 2


def piece_digest_of(content: bytes, piece_bytes: int = 8 << 20) -> str:
    """The registry's identity of `content`, worked out here from its definition (the oracle for
    shared/adapter_digest.py): sha256 over the sha256 of each `piece_bytes` piece, in order."""
    pieces = [hashlib.sha256(content[i : i + piece_bytes]).digest() for i in range(0, len(content), piece_bytes)]
    return "sha256-pieces-8MiB:" + hashlib.sha256(b"".join(pieces)).hexdigest()


class Lab:
    """An adapter root with acme's and globex's directories, a directory outside it, and the model."""

    def __init__(self, root: Path, outside: Path, model: ModelInfo) -> None:
        self.root, self.outside, self.model = root, outside, model
        self._count = 0
        for directory in (root / OWNER, root / OTHER, root / "shared", outside):
            directory.mkdir(parents=True, exist_ok=True)

    def valid(self, owner: str = OWNER, name: str | None = None, *, parent: Path | None = None) -> Path:
        """A valid adapter directory (q_proj of layer 0 at rank 2); returns it."""
        self._count += 1
        directory = (parent or self.root / owner) / (name or f"a{self._count}")
        directory.mkdir(parents=True)
        self.config(directory, {})
        self.weights(directory, self.table(), self.data())
        return directory

    def table(self) -> dict:
        in_features, out_features = self.model.projection_shape("q_proj")
        a_bytes, b_bytes = RANK * in_features * 4, out_features * RANK * 4
        return {
            A: {"dtype": "F32", "shape": [RANK, in_features], "data_offsets": [0, a_bytes]},
            B: {"dtype": "F32", "shape": [out_features, RANK], "data_offsets": [a_bytes, a_bytes + b_bytes]},
        }

    def data(self) -> bytes:
        in_features, out_features = self.model.projection_shape("q_proj")
        return np.ones(RANK * (in_features + out_features), np.float32).tobytes()

    @staticmethod
    def config(directory: Path, changes: dict, *, text: str | None = None) -> None:
        config = {"peft_type": "LORA", "r": RANK, "lora_alpha": 4, "target_modules": ["q_proj"], "bias": "none"}
        config.update(changes)
        (directory / "adapter_config.json").write_text(text if text is not None else json.dumps(config))

    @staticmethod
    def weights(directory: Path, table: dict | bytes, data: bytes, *, length: int | None = None) -> None:
        header = table if isinstance(table, bytes) else json.dumps(table).encode()
        prefix = struct.pack("<Q", len(header) if length is None else length)
        (directory / "adapter_model.safetensors").write_bytes(prefix + header + data)

    def rel(self, path: Path) -> str:
        return str(path.relative_to(self.root))


@dataclass(frozen=True)
class Hostile:
    name: str
    code: str
    build: Callable[[Lab], str]  # writes the case's files; returns the lora_path to send


def _table(change: Callable[[dict], object]) -> Callable[[Lab], str]:
    """A case whose header is the valid table after `change(table)` (data unchanged)."""

    def build(lab: Lab) -> str:
        directory = lab.valid()
        table = lab.table()
        change(table)
        lab.weights(directory, table, lab.data())
        return lab.rel(directory)

    return build


def _header(header: bytes, *, length: int | None = None, data: bytes | None = None) -> Callable[[Lab], str]:
    def build(lab: Lab) -> str:
        directory = lab.valid()
        lab.weights(directory, header, lab.data() if data is None else data, length=length)
        return lab.rel(directory)

    return build


def _raw_weights(content: bytes) -> Callable[[Lab], str]:
    def build(lab: Lab) -> str:
        directory = lab.valid()
        (directory / "adapter_model.safetensors").write_bytes(content)
        return lab.rel(directory)

    return build


def _data(change: Callable[[bytes], bytes]) -> Callable[[Lab], str]:
    def build(lab: Lab) -> str:
        directory = lab.valid()
        lab.weights(directory, lab.table(), change(lab.data()))
        return lab.rel(directory)

    return build


def _config(changes: dict | None = None, *, text: str | None = None) -> Callable[[Lab], str]:
    def build(lab: Lab) -> str:
        directory = lab.valid()
        lab.config(directory, changes or {}, text=text)
        return lab.rel(directory)

    return build


def _set(entry: str, field: str, value: object) -> Callable[[dict], None]:
    return lambda table: table[entry].__setitem__(field, value)


def _renamed(old: str, new: str) -> Callable[[dict], None]:
    return lambda table: table.__setitem__(new, table.pop(old))


SAFETENSORS_CASES = [
    Hostile("empty-file", "invalid_safetensors", _raw_weights(b"")),
    Hostile("seven-bytes", "invalid_safetensors", _raw_weights(b"\x08\x00\x00\x00\x00\x00\x00")),
    Hostile("header-length-past-the-file", "invalid_safetensors", _header(b"{}", length=1 << 20)),
    Hostile("header-length-2-to-the-63", "invalid_safetensors", _header(b"{}", length=1 << 63)),
    Hostile("header-length-over-the-limit", "invalid_safetensors", _header(b"{}", length=(64 << 20) + 1)),
    Hostile("header-not-utf8", "invalid_safetensors", _header(b'{"\xff\xfe": 1}')),
    Hostile("header-not-json", "invalid_safetensors", _header(b'{"a": ')),
    Hostile("header-a-list", "invalid_safetensors", _header(b"[1, 2]")),
    Hostile("header-a-string", "invalid_safetensors", _header(b'"tensors"')),
    Hostile("header-nested-100000-deep", "invalid_safetensors", _header(b'{"a": ' + b"[" * 100_000)),
    Hostile("header-utf16", "invalid_safetensors", _header('{"a": 1}'.encode("utf-16"))),
    Hostile("entry-a-number", "invalid_safetensors", _table(lambda t: t.__setitem__(A, 5))),
    Hostile("entry-a-list", "invalid_safetensors", _table(lambda t: t.__setitem__(A, [t[A]]))),
    Hostile("entry-null", "invalid_safetensors", _table(lambda t: t.__setitem__(A, None))),
    Hostile("entry-without-offsets", "invalid_safetensors", _table(lambda t: t[A].pop("data_offsets"))),
    Hostile("entry-with-an-extra-field", "invalid_safetensors", _table(_set(A, "stride", [1]))),
    Hostile("shape-a-string", "invalid_safetensors", _table(_set(A, "shape", "2,8"))),
    Hostile("shape-an-object", "invalid_safetensors", _table(_set(A, "shape", {"0": 2}))),
    Hostile("shape-with-a-string", "invalid_safetensors", _table(_set(A, "shape", [2, "8"]))),
    Hostile("shape-negative", "invalid_safetensors", _table(_set(A, "shape", [-2, -8]))),
    Hostile("shape-of-floats", "invalid_safetensors", _table(_set(A, "shape", [2.0, 8.0]))),
    Hostile("shape-of-bools", "invalid_safetensors", _table(_set(A, "shape", [True, 16]))),
    Hostile("shape-of-nine-dims", "invalid_safetensors", _table(_set(A, "shape", [1] * 7 + [2, 8]))),
    Hostile("shape-huge", "invalid_safetensors", _table(_set(A, "shape", [10**30, 8]))),
    Hostile(
        "shape-nan", "invalid_safetensors", _header(b'{"x": {"dtype": "F32", "shape": [NaN], "data_offsets": [0, 4]}}')
    ),
    Hostile("dtype-a-number", "invalid_safetensors", _table(_set(A, "dtype", 4))),
    Hostile("dtype-unknown", "invalid_safetensors", _table(_set(A, "dtype", "F128"))),
    Hostile("dtype-f64", "invalid_safetensors", _table(_set(A, "dtype", "F64"))),  # spans no longer match
    Hostile(
        "dtype-f64-consistent", "adapter_dtype_unsupported", _table(lambda t: t[A].update(dtype="F64", shape=[RANK, 4]))
    ),
    Hostile("dtype-i32", "adapter_dtype_unsupported", _table(_set(A, "dtype", "I32"))),
    Hostile("dtype-u8", "adapter_dtype_unsupported", _table(lambda t: t[A].update(dtype="U8", shape=[RANK, 32]))),
    Hostile("offsets-one-number", "invalid_safetensors", _table(_set(A, "data_offsets", [0]))),
    Hostile("offsets-three-numbers", "invalid_safetensors", _table(_set(A, "data_offsets", [0, 32, 64]))),
    Hostile("offsets-reversed", "invalid_safetensors", _table(_set(A, "data_offsets", [64, 0]))),
    Hostile("offsets-negative", "invalid_safetensors", _table(_set(A, "data_offsets", [-64, 0]))),
    Hostile("offsets-strings", "invalid_safetensors", _table(_set(A, "data_offsets", ["0", "64"]))),
    Hostile("offsets-a-string", "invalid_safetensors", _table(_set(A, "data_offsets", "0-64"))),
    Hostile("offsets-past-the-file", "invalid_safetensors", _table(_set(B, "data_offsets", [2**62, 2**62 + 64]))),
    Hostile("tensors-overlap", "invalid_safetensors", _table(lambda t: t[B].__setitem__("data_offsets", [0, 64]))),
    Hostile("tensors-leave-a-gap", "invalid_safetensors", lambda lab: _gap(lab)),
    Hostile("data-truncated", "invalid_safetensors", _data(lambda d: d[:-1])),
    Hostile("data-missing", "invalid_safetensors", _data(lambda d: b"")),
    Hostile("data-padded", "invalid_safetensors", _data(lambda d: d + b"junk")),
    Hostile("span-not-shape-times-dtype", "invalid_safetensors", _table(lambda t: t[A].update(shape=[RANK, 4]))),
    Hostile("duplicate-tensor-name", "invalid_safetensors", lambda lab: _duplicate_name(lab)),
    Hostile("metadata-a-list", "invalid_safetensors", _table(lambda t: t.__setitem__("__metadata__", ["x"]))),
    Hostile("metadata-not-strings", "invalid_safetensors", _table(lambda t: t.__setitem__("__metadata__", {"a": 1}))),
    Hostile(
        "shape-not-the-models",
        "adapter_shape_mismatch",
        _table(lambda t: (t[A].update(shape=[RANK * 2, 4]), t[B].update(shape=[4, RANK * 2]))),
    ),
    Hostile("rank-not-the-configs", "adapter_shape_mismatch", _config({"r": 1})),
    Hostile(
        "layer-past-the-model",
        "adapter_shape_mismatch",
        _table(
            lambda t: (
                _renamed(A, A.replace("layers.0", "layers.7"))(t),
                _renamed(B, B.replace("layers.0", "layers.7"))(t),
            )
        ),
    ),
    Hostile(
        "layer-index-of-40-digits",
        "adapter_shape_mismatch",
        _table(
            lambda t: (
                _renamed(A, A.replace("layers.0", "layers." + "9" * 40))(t),
                _renamed(B, B.replace("layers.0", "layers." + "9" * 40))(t),
            )
        ),
    ),
    Hostile("not-a-lora-matrix", "adapter_unsupported", _table(_renamed(A, "base_model.model.lm_head.weight"))),
    Hostile("no-tensors", "invalid_adapter", _header(b"{}", data=b"")),
    Hostile("a-without-b", "invalid_adapter", lambda lab: _a_without_b(lab)),
    Hostile("pickle-only", "adapter_file_missing", lambda lab: _pickle_only(lab)),
]


def _duplicate_name(lab: Lab) -> str:
    directory = lab.valid()
    table = lab.table()
    text = json.dumps(table)
    duplicate = json.dumps({A: table[B]})[1:-1]  # A's name again, with B's span: one span left uncovered
    lab.weights(directory, (text[:-1] + ", " + duplicate + "}").encode(), lab.data())
    return lab.rel(directory)


def _gap(lab: Lab) -> str:
    """B starts 64 bytes after A ends; the file holds those bytes, so only the gap is wrong."""
    directory = lab.valid()
    table = lab.table()
    begin, end = table[B]["data_offsets"]
    table[B]["data_offsets"] = [begin + 64, end + 64]
    data = lab.data()
    lab.weights(directory, table, data[:begin] + b"\0" * 64 + data[begin:])
    return lab.rel(directory)


def _a_without_b(lab: Lab) -> str:
    directory = lab.valid()
    table = lab.table()
    del table[B]
    lab.weights(directory, table, lab.data()[: table[A]["data_offsets"][1]])
    return lab.rel(directory)


def _pickle_only(lab: Lab) -> str:
    directory = lab.valid()
    (directory / "adapter_model.safetensors").rename(directory / "adapter_model.bin")
    return lab.rel(directory)


def _config_text(**raw_values: str) -> str:
    """A valid config's JSON with some values written verbatim (NaN, 1e999, huge integers)."""
    text = json.dumps({"peft_type": "LORA", "r": RANK, "lora_alpha": 4, "target_modules": ["q_proj"]})
    for name, raw in raw_values.items():
        current = {"r": str(RANK), "lora_alpha": "4"}[name]
        text = text.replace(f'"{name}": {current}', f'"{name}": {raw}')
    return text


def _config_bytes(lab: Lab, content: bytes) -> str:
    directory = lab.valid()
    (directory / "adapter_config.json").write_bytes(content)
    return lab.rel(directory)


CONFIG_CASES = [
    Hostile("config-not-json", "invalid_adapter_config", _config(text='{"r": 2,')),
    Hostile("config-empty", "invalid_adapter_config", _config(text="")),
    Hostile("config-not-utf8", "invalid_adapter_config", lambda lab: _config_bytes(lab, b'{"r": "\xff"}')),
    Hostile("config-a-list", "invalid_adapter_config", _config(text="[]")),
    Hostile("config-a-number", "invalid_adapter_config", _config(text="4")),
    Hostile(
        "config-nested-100000-deep",
        "invalid_adapter_config",
        _config(text='{"peft_type": "LORA", "x": ' + "[" * 100_000 + "]" * 100_000 + "}"),
    ),
    Hostile("config-nested-40-deep", "invalid_adapter_config", _config({"x": json.loads("[" * 40 + "]" * 40)})),
    Hostile("config-over-1-mib", "invalid_adapter_config", _config({"padding": "x" * (1 << 20)})),
    Hostile("config-duplicate-keys", "invalid_adapter_config", _config(text='{"peft_type": "LORA", "r": 2, "r": 4}')),
    Hostile("lora-alpha-nan", "invalid_adapter_config", _config(text=_config_text(lora_alpha="NaN"))),
    Hostile("lora-alpha-infinity", "invalid_adapter_config", _config(text=_config_text(lora_alpha="Infinity"))),
    Hostile("lora-alpha-minus-infinity", "invalid_adapter_config", _config(text=_config_text(lora_alpha="-Infinity"))),
    Hostile("lora-alpha-1e999", "invalid_adapter_config", _config(text=_config_text(lora_alpha="1e999"))),
    Hostile("lora-alpha-400-digits", "invalid_adapter_config", _config(text=_config_text(lora_alpha="9" * 400))),
    Hostile("lora-alpha-string", "invalid_adapter_config", _config({"lora_alpha": "16"})),
    Hostile("lora-alpha-null", "invalid_adapter_config", _config({"lora_alpha": None})),
    Hostile("lora-alpha-list", "invalid_adapter_config", _config({"lora_alpha": [16]})),
    Hostile("lora-alpha-object", "invalid_adapter_config", _config({"lora_alpha": {"value": 16}})),
    Hostile("lora-alpha-zero", "invalid_adapter_config", _config({"lora_alpha": 0})),
    Hostile("lora-alpha-negative", "invalid_adapter_config", _config({"lora_alpha": -8})),
    Hostile("lora-alpha-bool", "invalid_adapter_config", _config({"lora_alpha": True})),
    Hostile("r-zero", "invalid_adapter_config", _config({"r": 0})),
    Hostile("r-negative", "invalid_adapter_config", _config({"r": -2})),
    Hostile("r-string", "invalid_adapter_config", _config({"r": "2"})),
    Hostile("r-float", "invalid_adapter_config", _config({"r": 2.0})),
    Hostile("r-bool", "invalid_adapter_config", _config({"r": True})),
    Hostile("r-null", "invalid_adapter_config", _config({"r": None})),
    Hostile("r-list", "invalid_adapter_config", _config({"r": [2]})),
    Hostile("r-huge", "adapter_rank_too_large", _config(text=_config_text(r="9" * 400))),
    Hostile("r-over-the-limit", "adapter_rank_too_large", _config({"r": 4096})),
    Hostile("use-rslora-string", "invalid_adapter_config", _config({"use_rslora": "yes"})),
    Hostile("target-modules-regex", "adapter_unsupported", _config({"target_modules": ".*q_proj"})),
    Hostile("target-modules-numbers", "invalid_adapter_config", _config({"target_modules": [1]})),
    Hostile("target-modules-object", "invalid_adapter_config", _config({"target_modules": {"q_proj": True}})),
    Hostile("target-modules-null", "invalid_adapter_config", _config({"target_modules": None})),
    Hostile("target-modules-empty", "invalid_adapter_config", _config({"target_modules": []})),
    Hostile("target-modules-another-module", "adapter_config_mismatch", _config({"target_modules": ["k_proj"]})),
    Hostile("target-modules-more", "adapter_config_mismatch", _config({"target_modules": ["q_proj", "v_proj"]})),
    Hostile(
        "target-parameters-not-in-the-weights", "adapter_config_mismatch", _config({"target_parameters": ["down_proj"]})
    ),
    Hostile("target-parameters-string", "invalid_adapter_config", _config({"target_parameters": "down_proj"})),
    Hostile("target-parameters-unknown", "adapter_unsupported", _config({"target_parameters": ["lm_head"]})),
    Hostile(
        "rank-pattern-string-value",
        "invalid_adapter_config",
        _config({"target_parameters": ["down_proj"], "rank_pattern": {"down_proj": "8"}}),
    ),
    Hostile(
        "rank-pattern-a-list",
        "invalid_adapter_config",
        _config({"target_parameters": ["down_proj"], "rank_pattern": ["down_proj"]}),
    ),
    Hostile(
        "alpha-pattern-nan",
        "invalid_adapter_config",
        lambda lab: _config_bytes(
            lab,
            b'{"peft_type": "LORA", "r": 2, "target_modules": ["q_proj"], "target_parameters": ["down_proj"],'
            b' "alpha_pattern": {"down_proj": NaN}}',
        ),
    ),
    Hostile("peft-type-ia3", "adapter_unsupported", _config({"peft_type": "IA3"})),
    Hostile("peft-type-a-huge-list", "adapter_unsupported", _config({"peft_type": ["LORA"] * 10_000})),
    Hostile("dora", "adapter_unsupported", _config({"use_dora": True})),
    Hostile("modules-to-save", "adapter_unsupported", _config({"modules_to_save": ["lm_head"]})),
]


def _linked(file_name: str, target: Callable[[Lab], Path]) -> Callable[[Lab], str]:
    """An adapter whose `file_name` is a symlink to `target(lab)`."""

    def build(lab: Lab) -> str:
        directory = lab.valid()
        (directory / file_name).unlink()
        (directory / file_name).symlink_to(target(lab))
        return lab.rel(directory)

    return build


def _outside_file(file_name: str) -> Callable[[Lab], Path]:
    return lambda lab: lab.valid(parent=lab.outside) / file_name


def _others_file(file_name: str) -> Callable[[Lab], Path]:
    return lambda lab: lab.valid(OTHER) / file_name


def _special(file_name: str, make: Callable[[Path], None]) -> Callable[[Lab], str]:
    def build(lab: Lab) -> str:
        directory = lab.valid()
        (directory / file_name).unlink()
        make(directory / file_name)
        return lab.rel(directory)

    return build


def _linked_dir(lab: Lab) -> str:
    """acme/<link> → globex's adapter directory."""
    theirs = lab.valid(OTHER)
    link = lab.root / OWNER / f"link-{theirs.name}"
    link.symlink_to(theirs)
    return lab.rel(link)


def _linked_parent(lab: Lab) -> str:
    """acme/<group> → globex's directory, then an adapter inside it."""
    theirs = lab.valid(OTHER)
    link = lab.root / OWNER / f"group-{theirs.name}"
    link.symlink_to(lab.root / OTHER)
    return f"{OWNER}/{link.name}/{theirs.name}"


def _relative_link_inside(lab: Lab) -> str:
    """acme/<link> → a sibling adapter of acme's own (inside its directory, still a symlink)."""
    own = lab.valid()
    link = lab.root / OWNER / f"alias-{own.name}"
    link.symlink_to(own.name)
    return lab.rel(link)


def _hard_link(lab: Lab) -> str:
    directory = lab.valid()
    theirs = lab.valid(OTHER)
    (directory / "adapter_model.safetensors").unlink()
    os.link(theirs / "adapter_model.safetensors", directory / "adapter_model.safetensors")
    return lab.rel(directory)


def _loop(lab: Lab) -> str:
    directory = lab.valid()
    (directory / "adapter_model.safetensors").unlink()
    (directory / "adapter_model.safetensors").symlink_to("adapter_model.safetensors")
    return lab.rel(directory)


FILE_CASES = [
    Hostile(
        "weights-symlink-outside-the-root",
        "adapter_symlink",
        _linked("adapter_model.safetensors", _outside_file("adapter_model.safetensors")),
    ),
    Hostile(
        "weights-symlink-to-another-tenants",
        "adapter_symlink",
        _linked("adapter_model.safetensors", _others_file("adapter_model.safetensors")),
    ),
    Hostile(
        "config-symlink-outside-the-root",
        "adapter_symlink",
        _linked("adapter_config.json", _outside_file("adapter_config.json")),
    ),
    Hostile(
        "config-symlink-to-another-tenants",
        "adapter_symlink",
        _linked("adapter_config.json", _others_file("adapter_config.json")),
    ),
    Hostile(
        "weights-symlink-to-etc-passwd",
        "adapter_symlink",
        _linked("adapter_model.safetensors", lambda lab: Path("/etc/passwd")),
    ),
    Hostile(
        "weights-symlink-to-dev-zero",
        "adapter_symlink",
        _linked("adapter_model.safetensors", lambda lab: Path("/dev/zero")),
    ),
    Hostile(
        "weights-dangling-symlink",
        "adapter_symlink",
        _linked("adapter_model.safetensors", lambda lab: lab.root / "nowhere"),
    ),
    Hostile("weights-symlink-loop", "adapter_symlink", _loop),
    Hostile("adapter-dir-symlink-to-another-tenants", "adapter_symlink", _linked_dir),
    Hostile("parent-dir-symlink-to-another-tenants", "adapter_symlink", _linked_parent),
    Hostile("adapter-dir-symlink-to-its-own-sibling", "adapter_symlink", _relative_link_inside),
    Hostile("weights-hard-link-to-another-tenants", "adapter_file_not_regular", _hard_link),
    Hostile("weights-a-fifo", "adapter_file_not_regular", _special("adapter_model.safetensors", os.mkfifo)),
    Hostile("config-a-fifo", "adapter_file_not_regular", _special("adapter_config.json", os.mkfifo)),
    Hostile(
        "weights-a-directory", "adapter_file_not_regular", _special("adapter_model.safetensors", lambda p: p.mkdir())
    ),
    Hostile("config-a-directory", "adapter_file_not_regular", _special("adapter_config.json", lambda p: p.mkdir())),
    Hostile("weights-missing", "adapter_file_missing", _special("adapter_model.safetensors", lambda p: None)),
    Hostile("config-missing", "adapter_file_missing", _special("adapter_config.json", lambda p: None)),
    Hostile("adapter-a-file", "adapter_path_not_found", lambda lab: lab.rel(lab.valid() / "adapter_config.json")),
    Hostile("adapter-missing", "adapter_path_not_found", lambda lab: f"{OWNER}/no-such-adapter"),
]


def _nth(lab: Lab, owner: str) -> str:
    return lab.rel(lab.valid(owner))


PATH_CASES = [
    Hostile("nul-byte", "invalid_adapter_path", lambda lab: f"{OWNER}/a\x00b"),
    Hostile("nul-byte-at-the-end", "invalid_adapter_path", lambda lab: _nth(lab, OWNER) + "\x00"),
    Hostile("newline", "invalid_adapter_path", lambda lab: f"{OWNER}/a\nb"),
    Hostile("tab", "invalid_adapter_path", lambda lab: f"{OWNER}/a\tb"),
    Hostile("delete-character", "invalid_adapter_path", lambda lab: f"{OWNER}/a\x7fb"),
    Hostile("path-of-5000-characters", "invalid_adapter_path", lambda lab: f"{OWNER}/" + "a/" * 2500),
    Hostile("component-of-300-characters", "invalid_adapter_path", lambda lab: f"{OWNER}/" + "a" * 300),
    Hostile("component-of-256-bytes", "invalid_adapter_path", lambda lab: f"{OWNER}/" + "é" * 128),
    Hostile("component-of-10000-characters", "invalid_adapter_path", lambda lab: "x" * 10_000),
    Hostile("dotdot-into-another-tenant", "adapter_path_outside_root", lambda lab: f"{OWNER}/../" + _nth(lab, OTHER)),
    Hostile("dotdot-out-of-the-root", "adapter_path_outside_root", lambda lab: f"{OWNER}/../../outside"),
    Hostile("dotdot-alone", "adapter_path_outside_root", lambda lab: ".."),
    Hostile("dotdot-at-the-end", "adapter_path_outside_root", lambda lab: _nth(lab, OWNER) + "/.."),
    Hostile("dotdot-between-empty-components", "adapter_path_outside_root", lambda lab: f"{OWNER}//..//{OTHER}/x"),
    Hostile("absolute-outside-the-root", "adapter_path_outside_root", lambda lab: "/etc"),
    Hostile(
        "absolute-outside-into-a-valid-adapter",
        "adapter_path_outside_root",
        lambda lab: str(lab.valid(parent=lab.outside)),
    ),
    Hostile("slash", "adapter_path_outside_root", lambda lab: "/"),
    Hostile("only-slashes", "adapter_path_outside_root", lambda lab: "////"),
    Hostile("another-tenants-adapter", "adapter_path_forbidden", lambda lab: _nth(lab, OTHER)),
    Hostile("another-tenants-missing-adapter", "adapter_path_forbidden", lambda lab: f"{OTHER}/no-such-adapter"),
    Hostile("another-tenants-adapter-absolute", "adapter_path_forbidden", lambda lab: str(lab.root / _nth(lab, OTHER))),
    Hostile("another-tenants-adapter-dotted", "adapter_path_forbidden", lambda lab: "./" + _nth(lab, OTHER) + "/"),
    Hostile("another-tenants-directory", "adapter_path_forbidden", lambda lab: OTHER),
    Hostile("shared-adapter", "adapter_path_forbidden", lambda lab: _nth(lab, "shared")),
    Hostile("own-directory-itself", "adapter_path_forbidden", lambda lab: OWNER),
    Hostile("the-root-itself", "adapter_path_forbidden", lambda lab: "."),
    Hostile("owner-in-upper-case", "adapter_path_forbidden", lambda lab: _nth(lab, OWNER).upper()),
    Hostile("owner-in-fullwidth-letters", "adapter_path_forbidden", lambda lab: "ａｃｍｅ/x"),
    Hostile("backslashes", "adapter_path_forbidden", lambda lab: _nth(lab, OWNER).replace("/", "\\")),
    Hostile("tilde", "adapter_path_forbidden", lambda lab: "~/x"),
    Hostile("tilde-owner", "adapter_path_forbidden", lambda lab: f"~{OWNER}/x"),
    Hostile("file-url", "adapter_path_forbidden", lambda lab: "file:///etc/passwd"),
    Hostile("percent-encoded-dotdot", "adapter_path_not_found", lambda lab: f"{OWNER}/%2e%2e/{OTHER}"),
]
# path forms that name a valid adapter of acme's: each must be accepted
EQUIVALENT_PATHS: list[Callable[[str, Path], str]] = [
    lambda rel, root: rel,
    lambda rel, root: "./" + rel,
    lambda rel, root: rel.replace("/", "//"),
    lambda rel, root: rel + "/",
    lambda rel, root: rel.replace("/", "/./"),
    lambda rel, root: str(root / rel),
    lambda rel, root: str(root) + "//" + rel + "/.",
]
ALL_CASES = SAFETENSORS_CASES + CONFIG_CASES + FILE_CASES + PATH_CASES
