"""The host tier's arena: blocks carved first-fit inside sections of one largest adapter, given
back and merged, and the reads' bookkeeping that gives blocks back when a read fails."""

from __future__ import annotations

import pytest
import torch

from worker.adapter_pool.host_arena import ALIGNMENT, ArenaAllocator, ArenaFull, ArenaTooSmall, Carving, HostArena

SECTION = 4 * ALIGNMENT


def test_blocks_are_carved_first_fit_aligned_and_never_straddle_a_section():
    arena = ArenaAllocator(2 * SECTION + ALIGNMENT, SECTION)  # two sections and a short third
    assert arena.sections == 3
    assert arena.carve(1) == 0  # rounded up to the alignment
    assert arena.carve(2 * ALIGNMENT) == ALIGNMENT
    # one alignment unit left in the first section: a block of two goes to the second
    assert arena.carve(2 * ALIGNMENT) == SECTION
    assert arena.carve(ALIGNMENT) == 3 * ALIGNMENT
    assert arena.used_bytes == 6 * ALIGNMENT


def test_freed_blocks_merge_with_the_holes_beside_them():
    arena = ArenaAllocator(SECTION, SECTION)
    first, middle, last = (arena.carve(ALIGNMENT) for _ in range(3))
    arena.free(first)
    arena.free(last)
    assert arena.holes() == [(0, ALIGNMENT), (2 * ALIGNMENT, SECTION)]
    arena.free(middle)
    assert arena.holes() == [(0, SECTION)] and arena.used_bytes == 0
    assert arena.bookkeeping_size() == 0


def test_a_block_that_fits_the_free_bytes_but_no_hole_waits_for_a_neighbour_to_go():
    arena = ArenaAllocator(SECTION, SECTION)
    blocks = [arena.carve(ALIGNMENT) for _ in range(4)]
    arena.free(blocks[0])
    arena.free(blocks[2])
    assert arena.carve(2 * ALIGNMENT) is None  # two units free, apart
    arena.free(blocks[1])
    assert arena.carve(2 * ALIGNMENT) == 0


def test_a_block_larger_than_a_section_is_refused_naming_the_settings():
    arena = ArenaAllocator(10 * SECTION, SECTION)
    with pytest.raises(ArenaTooSmall, match=r"raise --adapter-host-cache-gb or --max-lora-rank"):
        arena.carve(SECTION + 1)


def test_an_arena_on_the_cpu_hands_out_views_of_one_plain_buffer():
    arena = HostArena(2 * SECTION, SECTION, page_locked=False)
    block = arena.carve(SECTION)
    assert block.dtype == torch.uint8 and block.numel() == SECTION and not block.is_pinned()
    assert block.data_ptr() == arena.buffer.data_ptr()
    block.view(torch.float32).fill_(1.5)
    assert arena.section_of(arena.carve(8)) == 1
    arena.free(block.view(torch.float32))  # any dtype's view of the block gives it back
    assert arena.allocator.used_bytes == ALIGNMENT
    with pytest.raises(ValueError, match="not a block of this arena"):
        arena.free(torch.empty(4, dtype=torch.uint8))


def test_a_read_gives_back_what_it_took_unless_it_kept_it():
    arena = HostArena(2 * SECTION, SECTION, page_locked=False)
    failed = Carving(arena)
    failed.take(ALIGNMENT)
    failed.keep(None)  # the read failed
    assert arena.allocator.used_bytes == 0

    granted = arena.carve(SECTION)
    read = Carving(arena, granted)
    assert read.take(SECTION).data_ptr() == granted.data_ptr()  # the block carved for it
    with pytest.raises(ArenaFull) as full:  # the other section holds one more, no more
        read.take(SECTION)
        read.take(SECTION)
    assert full.value.nbytes == SECTION
    read.keep(granted)
    assert arena.allocator.used_bytes == SECTION


def test_a_grant_of_another_size_is_given_back():
    arena = HostArena(2 * SECTION, SECTION, page_locked=False)
    read = Carving(arena, arena.carve(SECTION))
    kept = read.take(ALIGNMENT)  # the file changed size since: carved anew
    read.keep(kept)
    assert arena.allocator.used_bytes == ALIGNMENT
