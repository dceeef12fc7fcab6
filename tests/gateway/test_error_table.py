"""The README's tables of error codes (by status, and the adapter refusals) are complete, and give each
code the status the gateway sends."""

from __future__ import annotations

import re
from pathlib import Path

from gateway.errors import status_for
from shared.errors import ErrorCode

README = Path(__file__).resolve().parents[2] / "README.md"


def table_rows(header: str) -> list[tuple[str, set[str]]]:
    """(first cell, the error codes named in the other cells) per row of the README's table with `header`."""
    lines = README.read_text().splitlines()
    start = lines.index(header) + 2
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        first, rest = line.strip("|").split("|", 1)
        codes = set(re.findall(r"`([a-z_]+)`", rest)) & {code.value for code in ErrorCode}
        rows.append((first.strip(), codes))
    return rows


def test_every_error_code_is_in_the_readme_tables() -> None:
    refusals = {first.strip("`").split("` / `")[0] for first, _ in table_rows("| code | the adapter |")}
    refusals |= {first.strip("`").split("` / `")[-1] for first, _ in table_rows("| code | the adapter |")}
    listed = set().union(refusals, *(codes for _, codes in table_rows("| status | codes |")))
    assert sorted({code.value for code in ErrorCode} - listed) == []


def test_each_listed_code_has_the_status_of_its_row() -> None:
    for status, codes in table_rows("| status | codes |"):
        if status.isdigit():
            assert {code: status_for(ErrorCode(code)) for code in codes} == dict.fromkeys(codes, int(status))
