"""The README's table of error codes is complete and gives each code the status the gateway sends."""

from __future__ import annotations

import re
from pathlib import Path

from gateway.errors import status_for
from shared.errors import ErrorCode

README = Path(__file__).resolve().parents[2] / "README.md"


def table_rows() -> list[tuple[str, set[str]]]:
    """(first cell, the error codes named in the row) per row of the README's `| status | codes |` table."""
    lines = README.read_text().splitlines()
    start = lines.index("| status | codes |") + 2
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        first, rest = line.strip("|").split("|", 1)
        codes = set(re.findall(r"`([a-z_]+)`", rest)) & {code.value for code in ErrorCode}
        rows.append((first.strip(), codes))
    return rows


def test_every_error_code_is_in_the_readme_table() -> None:
    listed = set().union(*(codes for _, codes in table_rows()))
    assert sorted({code.value for code in ErrorCode} - listed) == []


def test_each_listed_code_has_the_status_of_its_row() -> None:
    for status, codes in table_rows():
        if status.isdigit():
            assert {code: status_for(ErrorCode(code)) for code in codes} == dict.fromkeys(codes, int(status))
