"""Typed reads of one decoded wire map (a queue message's msgpack map, or a job hash's fields), so a
value of the wrong type or range is refused at the boundary, never deep inside a worker: every
failure is one SchemaError whose message names the field by its path (`sampling.top_p`).

The wire is written by our own gateways, but also by an older or newer release during an upgrade, a
restore from backup or a buggy tool: a worker must be able to refuse what it reads, not crash on it.
"""

from __future__ import annotations

import math
from typing import Any

_REQUIRED = object()


class SchemaError(ValueError):
    """A message or record that does not decode into the schema this process speaks."""


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__


class Fields:
    """Typed reads of the map `data`, found at `path` (empty for the message itself)."""

    __slots__ = ("_data", "_path")

    def __init__(self, data: Any, path: str = "") -> None:
        if not isinstance(data, dict):
            raise SchemaError(f"{path or 'the message'} must be a map, not {_kind(data)}")
        self._data = data
        self._path = path

    def _name(self, name: str) -> str:
        return f"{self._path}.{name}" if self._path else name

    def _get(self, name: str, default: Any) -> Any:
        if name in self._data:
            return self._data[name]
        if default is _REQUIRED:
            raise SchemaError(f"{self._name(name)} is missing")
        return default

    def _wrong(self, name: str, expected: str, value: Any) -> SchemaError:
        return SchemaError(f"{self._name(name)} must be {expected}, not {_kind(value)}")

    def integer(self, name: str, low: int, high: int, *, default: Any = _REQUIRED) -> Any:
        """An int in [low, high] (a bool is not one); `default` when absent, which may be None."""
        value = self._get(name, default)
        if value is None and default is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            raise self._wrong(name, "an integer", value)
        if not low <= value <= high:
            raise SchemaError(f"{self._name(name)} must be in [{low}, {high}]")
        return value

    def number(self, name: str, low: float, high: float, *, default: Any = _REQUIRED) -> Any:
        """A finite float (from an int or a float) in [low, high]; `default` when absent, which may be None."""
        value = self._get(name, default)
        if value is None and default is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self._wrong(name, "a number", value)
        try:
            number = float(value)
        except OverflowError:  # an integer past float's range
            number = math.inf
        if not (math.isfinite(number) and low <= number <= high):
            raise SchemaError(f"{self._name(name)} must be a finite number in [{low}, {high}]")
        return number

    def text(self, name: str, max_chars: int, *, min_chars: int = 0, default: Any = _REQUIRED) -> str:
        value = self._get(name, default)
        if not isinstance(value, str):
            raise self._wrong(name, "a string", value)
        if not min_chars <= len(value) <= max_chars:
            raise SchemaError(f"{self._name(name)} must be {min_chars} to {max_chars} characters")
        return value

    def flag(self, name: str, *, default: Any = _REQUIRED) -> bool:
        value = self._get(name, default)
        if not isinstance(value, bool):
            raise self._wrong(name, "true or false", value)
        return value

    def integers(self, name: str, low: int, high: int, *, min_items: int, max_items: int) -> tuple[int, ...]:
        """A list of ints in [low, high], min_items to max_items long."""
        value = self._get(name, _REQUIRED)
        if not isinstance(value, list | tuple):
            raise self._wrong(name, "a list of integers", value)
        if not min_items <= len(value) <= max_items:
            raise SchemaError(f"{self._name(name)} must hold {min_items} to {max_items} items")
        # C-speed checks first (outputs and prompts run to thousands of ids); `type(...) is int` refuses bools
        if not all(type(item) is int for item in value) or (value and (min(value) < low or max(value) > high)):
            i, item = next((i, v) for i, v in enumerate(value) if type(v) is not int or not low <= v <= high)
            raise SchemaError(f"{self._name(name)}[{i}] must be an integer in [{low}, {high}], not {item!r:.40}")
        return tuple(value)

    def texts(self, name: str, max_chars: int, *, max_items: int) -> tuple[str, ...]:
        """A list of at most max_items strings of at most max_chars each."""
        value = self._get(name, _REQUIRED)
        if not isinstance(value, list | tuple):
            raise self._wrong(name, "a list of strings", value)
        if len(value) > max_items:
            raise SchemaError(f"{self._name(name)} must hold at most {max_items} items")
        for i, item in enumerate(value):
            if not isinstance(item, str) or len(item) > max_chars:
                raise SchemaError(f"{self._name(name)}[{i}] must be a string of at most {max_chars} characters")
        return tuple(value)

    def nested(self, name: str, *, optional: bool = False) -> Fields | None:
        """The map under `name`; None when it is null and `optional`."""
        value = self._get(name, _REQUIRED)
        if value is None and optional:
            return None
        return Fields(value, self._name(name))
