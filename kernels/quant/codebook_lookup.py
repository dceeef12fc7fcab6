"""A fixed 16-level codebook (NF4, FP4: codebook.py) looked up in registers, for int4_gemm.py's
dequantization on the GPU: one inline-PTX call turns a packed int32 (eight 4-bit codes, code j at bits
4j) into the eight float32 levels, bit for bit the table's, with no memory access per weight.

The levels are split into byte planes: plane b's four words hold byte b of levels 0-3, 4-7, 8-11
and 12-15. `prmt.b32` picks four bytes out of two words by four 3-bit
selectors, so for four codes at once (the low or high 16 bits of the packed int32, one selector
nibble each) a plane takes two permutes, one over levels 0-7 and one over 8-15, and a byte-wise
select by each code's bit 3. prmt reads a selector nibble's bit 3 as "replicate the byte's sign", so
the selectors are masked with 0x7777, and the same mode builds the select mask: a byte holding code
j's bit 3 as its top bit, replicated, is 0xFF for codes 8-15. Eight more permutes transpose the four
planes of four codes into four float32 words. A table whose levels 8-15 are levels 0-7 negated (FP4)
needs no select: one permute a plane over levels 0-7, and each code's bit 3 becomes its sign bit.

A permute reads one of its two table words as an immediate, the other from a register. ptxas holds a
constant, and any value it can prove the same in every thread of a warp, in a uniform register, which
prmt cannot read: it copied the word into an ordinary register before every permute (an instruction
on the FMA pipe each, and more registers live). So the kernel passes those words in (`table`: 8 for
NF4, 4 for FP4), each or-ed with a zero ptxas cannot see through: they are loaded into ordinary
registers once per program and stay there.

The program is a list of instructions (`lookup_program`), rendered as PTX (`lookup_ptx`) and checked
instruction by instruction on the host by tests/kernels/test_codebook_lookup.py.

    for j in range(8): level[j] = table[(packed >> 4 * j) & 0xF]
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import NamedTuple

import triton
import triton.language as tl

from kernels.quant.codebook import codebook

# (opcode, destination, sources): sources are register names or 32-bit immediates; "$0".."$7" are the
# eight levels, "$8" the packed int32
Instruction = tuple[str, str, tuple[str | int, ...]]

PACKED = "$8"
# the table words the program reads from registers, LookupProgram.table[i] in operand "$(9 + i)"
FIRST_TABLE_OPERAND = 9
# lop3's truth tables: (a & ~c) | (b & c), a byte of b where c's byte is 0xFF, else a's; a | (b & c)
_SELECT = 0xD8
_OR_MASKED = 0xF8
_SIGN = 0x80000000
# prmt selectors of the byte whose top bit is code j's bit 3, sign-replicated: for codes 0-3 and
# 4-7, from the packed word (bytes 0-3: odd codes' bit 3 on top) and the word shifted left by 4
# (bytes 4-7: even codes')
_MASK_SELECTORS = (0x9D8C, 0xBFAE)
# the 4x4 byte transpose: words of planes (0, 1) and (2, 3) interleaved by code pairs, then paired up
_INTERLEAVE = (0x5140, 0x7362)
_PAIR = (0x5410, 0x7632)


def _bits(level: float) -> int:
    return struct.unpack("<I", struct.pack("<f", level))[0]


class LookupProgram(NamedTuple):
    """Instructions mapping PACKED to "$0".."$7", and the table words they read from registers
    (`table[i]`, unsigned 32-bit, in operand FIRST_TABLE_OPERAND + i)."""

    instructions: list[Instruction]
    table: tuple[int, ...]


def lookup_program(levels: Sequence[float]) -> LookupProgram:
    """The program whose outputs "$0".."$7" are the float32 bits of levels[code j], code j at bits 4j
    of PACKED; `levels`: 16 float32 values."""
    if len(levels) != 16:
        raise ValueError(f"a 4-bit codebook has 16 levels, not {len(levels)}")
    bits = [_bits(level) for level in levels]
    # levels 8-15 the negated 0-7 (FP4): one permute a plane, and code j's bit 3 as the sign
    symmetric = all(bits[j] < _SIGN and bits[j + 8] == bits[j] | _SIGN for j in range(8))

    def plane_word(byte: int, first: int) -> int:  # byte `byte` of levels first..first+3
        return sum(((bits[first + i] >> (8 * byte)) & 0xFF) << (8 * i) for i in range(4))

    table: list[int] = []

    def in_register(word: int) -> str:
        if word not in table:
            table.append(word)
        return f"${FIRST_TABLE_OPERAND + table.index(word)}"

    program: list[Instruction] = [
        ("and", "sel0", (PACKED, 0x77777777)),
        ("shr", "sel1", ("sel0", 16)),
        ("shl", "shifted", (PACKED, 4)),
    ]
    program += [("prmt", f"mask{half}", (PACKED, "shifted", _MASK_SELECTORS[half])) for half in (0, 1)]
    for half in (0, 1):
        selectors, mask = f"sel{half}", f"mask{half}"
        for byte in range(4):
            plane = f"plane{byte}"
            low_levels = (in_register(plane_word(byte, 0)), plane_word(byte, 4), selectors)
            if symmetric:
                program.append(("prmt", plane, low_levels))
            else:
                program += [
                    ("prmt", "low", low_levels),
                    ("prmt", "high", (in_register(plane_word(byte, 8)), plane_word(byte, 12), selectors)),
                    ("lop3", plane, ("low", "high", mask, _SELECT)),
                ]
        if symmetric:
            program.append(("lop3", "plane3", ("plane3", mask, 0x80808080, _OR_MASKED)))
        program += _transpose(first_output=4 * half)
    return LookupProgram(program, tuple(table))


def _transpose(first_output: int) -> list[Instruction]:
    """plane0..plane3 (byte i of plane b: byte b of code i's level) into four float32 outputs."""
    program: list[Instruction] = []
    for pair in (0, 1):  # mix{pair}: codes 2 * pair and 2 * pair + 1 of planes 0, 1; mix{pair + 2}: of 2, 3
        program.append(("prmt", f"mix{pair}", ("plane0", "plane1", _INTERLEAVE[pair])))
        program.append(("prmt", f"mix{pair + 2}", ("plane2", "plane3", _INTERLEAVE[pair])))
    for code in range(4):
        mixes = ("mix0", "mix2") if code < 2 else ("mix1", "mix3")
        program.append(("prmt", f"${first_output + code}", (*mixes, _PAIR[code % 2])))
    return program


def lookup_ptx(levels: Sequence[float]) -> str:
    """lookup_program(levels) as a PTX block for tl.inline_asm_elementwise."""
    program = lookup_program(levels).instructions
    temporaries = sorted({dest for _, dest, _ in program if not dest.startswith("$")})
    lines = [f".reg .b32 {', '.join(temporaries)};"]
    for opcode, dest, sources in program:
        operands = ", ".join(hex(s) if isinstance(s, int) else s for s in sources)
        lines.append(f"{opcode}.b32 {dest}, {operands};")
    return "{\n" + "\n".join(lines) + "\n}"


def _constraints(levels: Sequence[float]) -> str:
    return "=r," * 8 + "r" + ",r" * len(lookup_program(levels).table)


def _signed_table(levels: Sequence[float]) -> tuple[int, ...]:  # as Triton's int32 constants
    return tuple(word - (1 << 32) if word >= _SIGN else word for word in lookup_program(levels).table)


_NF4, _FP4 = codebook("nf4").tolist(), codebook("fp4").tolist()
NF4_PTX, FP4_PTX = tl.constexpr(lookup_ptx(_NF4)), tl.constexpr(lookup_ptx(_FP4))
NF4_CONSTRAINTS, FP4_CONSTRAINTS = tl.constexpr(_constraints(_NF4)), tl.constexpr(_constraints(_FP4))
NF4_TABLE, FP4_TABLE = tl.constexpr(_signed_table(_NF4)), tl.constexpr(_signed_table(_FP4))


@triton.jit
def _unprovable_zero():
    """int32 0 that ptxas can neither prove zero nor prove the same in every thread of a warp: a lane's own
    bit and-ed with the bits of the lanes below it."""
    return tl.inline_asm_elementwise(
        "{\n.reg .b32 own, below;\nmov.u32 own, %lanemask_eq;\nmov.u32 below, %lanemask_lt;\n"
        "and.b32 $0, own, below;\n}",
        "=r",
        [],
        dtype=tl.int32,
        is_pure=True,
        pack=1,
    )


@triton.jit
def lookup_levels(packed, TABLE: tl.constexpr):
    """float32 [R, 8, C]: [i, j, c] the level of code j of packed int32 [R, C]'s [i, c] in the fixed
    table TABLE ("nf4" or "fp4")."""
    if TABLE == "nf4":
        ptx: tl.constexpr = NF4_PTX
        constraints: tl.constexpr = NF4_CONSTRAINTS
        table: tl.constexpr = NF4_TABLE
    else:
        ptx: tl.constexpr = FP4_PTX
        constraints: tl.constexpr = FP4_CONSTRAINTS
        table: tl.constexpr = FP4_TABLE
    zero = _unprovable_zero()
    operands = (packed,)
    for i in tl.static_range(len(table)):
        operands = operands + (zero | table[i],)  # noqa: RUF005 (Triton's frontend has no starred tuples)
    l0, l1, l2, l3, l4, l5, l6, l7 = tl.inline_asm_elementwise(
        ptx,
        constraints,
        operands,
        dtype=(tl.float32, tl.float32, tl.float32, tl.float32, tl.float32, tl.float32, tl.float32, tl.float32),
        is_pure=True,
        pack=1,
    )
    # each join adds a last axis of 2 held in registers: joined as (code bit 2, bit 1, bit 0), the
    # reshape flattens it to code order
    levels = tl.join(tl.join(tl.join(l0, l4), tl.join(l2, l6)), tl.join(tl.join(l1, l5), tl.join(l3, l7)))
    return tl.permute(tl.reshape(levels, (packed.shape[0], packed.shape[1], 8)), (0, 2, 1))
