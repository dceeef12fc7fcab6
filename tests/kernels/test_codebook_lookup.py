"""The register lookup of a fixed codebook (kernels/quant/codebook_lookup.py), run on the host: each
instruction of its program executed as the PTX ISA defines it, over every code at every nibble position
of a packed int32. (The GPU runs the PTX itself in tests/kernels/test_codebook.py.)"""

from __future__ import annotations

import random
import struct

import pytest

from kernels.quant.codebook import NF4_CODES, codebook
from kernels.quant.codebook_lookup import FIRST_TABLE_OPERAND, PACKED, LookupProgram, lookup_program, lookup_ptx

WORD = 0xFFFFFFFF


def prmt(a: int, b: int, selector: int) -> int:
    """prmt.b32's default mode: output byte i is byte (s & 7) of {b, a}, or that byte's top bit replicated
    when s & 8, for s the selector's nibble i."""
    source = a | (b << 32)
    out = 0
    for i in range(4):
        s = (selector >> (4 * i)) & 0xF
        byte = (source >> (8 * (s & 7))) & 0xFF
        if s & 8:
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << (8 * i)
    return out


def lop3(a: int, b: int, c: int, table: int) -> int:
    """lop3.b32: bit by bit, bit (4a + 2b + c) of `table`."""
    out = 0
    for index in range(8):
        if table >> index & 1:
            out |= (a if index & 4 else ~a) & (b if index & 2 else ~b) & (c if index & 1 else ~c)
    return out & WORD


OPERATIONS = {
    "and": lambda a, b: a & b,
    "shr": lambda a, b: a >> b,
    "shl": lambda a, b: (a << b) & WORD,
    "prmt": prmt,
    "lop3": lop3,
}


def run(program: LookupProgram, packed: int) -> list[int]:
    """The eight outputs, the table words in their operands as the kernel passes them."""
    registers = {PACKED: packed} | {f"${FIRST_TABLE_OPERAND + i}": word for i, word in enumerate(program.table)}
    for opcode, dest, sources in program.instructions:
        registers[dest] = OPERATIONS[opcode](*(s if isinstance(s, int) else registers[s] for s in sources))
    return [registers[f"${j}"] for j in range(8)]


def float_bits(level: float) -> int:
    return struct.unpack("<I", struct.pack("<f", level))[0]


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_every_code_at_every_position_gives_its_levels_bits(quant_type: str):
    levels = codebook(quant_type).tolist()
    program = lookup_program(levels)
    rotations = [sum(((first + j) % 16) << (4 * j) for j in range(8)) for first in range(16)]
    words = rotations + [random.Random(0).getrandbits(32) for _ in range(500)]
    for packed in words:
        expected = [float_bits(levels[(packed >> (4 * j)) & 0xF]) for j in range(8)]
        assert run(program, packed) == expected, hex(packed)


def test_a_table_of_negated_halves_takes_one_permute_a_plane():
    nf4, fp4 = lookup_program(NF4_CODES).instructions, lookup_program(codebook("fp4").tolist()).instructions
    assert len(fp4) < len(nf4)
    assert sum(opcode == "prmt" for opcode, _, _ in fp4) == 2 + 2 * (4 + 8)  # masks, then per half lookups, transpose


@pytest.mark.parametrize(("quant_type", "in_registers"), [("nf4", 8), ("fp4", 4)])
def test_each_table_permute_reads_one_word_from_a_register_and_one_immediate(quant_type: str, in_registers: int):
    program = lookup_program(codebook(quant_type).tolist())
    assert len(program.table) == in_registers
    operands = {f"${FIRST_TABLE_OPERAND + i}" for i in range(in_registers)}
    table_permutes = [
        sources for opcode, _, sources in program.instructions if opcode == "prmt" and sources[0] in operands
    ]
    assert len(table_permutes) == 2 * 4 * (1 if quant_type == "fp4" else 2)  # halves, planes, permutes a plane
    assert all(isinstance(second, int) for _, second, _ in table_permutes)


def test_the_ptx_declares_its_temporaries_and_writes_eight_levels():
    ptx = lookup_ptx(NF4_CODES)
    assert ptx.startswith("{\n.reg .b32 ") and ptx.endswith("\n}")
    assert all(f"prmt.b32 ${j}," in ptx for j in range(8))
    with pytest.raises(ValueError, match="16 levels"):
        lookup_ptx(NF4_CODES[:8])
