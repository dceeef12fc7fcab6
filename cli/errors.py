"""The one exception type a command raises to fail cleanly: `error: [code: ]message` on stderr, no traceback."""

from __future__ import annotations


class CommandError(Exception):
    def __init__(self, message: str, *, code: str | None = None, exit_code: int = 1) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.exit_code = exit_code

    def __str__(self) -> str:
        return f"{self.code}: {self.message}" if self.code else self.message
