"""KV pool: block allocation, all-or-nothing reservation, rollback by length, no leaks."""

import os
import random

import pytest
import torch

from specstream.memory.kv import KVPool, LayerGroup, plan_groups
from specstream.memory.blocks import NO_BLOCK


def make_pool(tokens=64, block=4):
    return KVPool(num_layers=2, num_kv_heads=2, head_dim=4, num_tokens=tokens, block_size=block, dtype=torch.float32, device="cpu")


def test_reserve_grows_table_by_whole_blocks():
    pool, table = make_pool(), []
    assert pool.reserve(table, 5)
    assert len(table) == 2 and pool.num_free_blocks == 14


def test_reserve_is_all_or_nothing_when_pool_is_short():
    pool, a, b = make_pool(tokens=16), [], []
    assert pool.reserve(a, 12)
    assert not pool.reserve(b, 8)
    assert b == [] and pool.num_free_blocks == 1


def test_trim_returns_blocks_past_length():
    pool, table = make_pool(), []
    pool.reserve(table, 16)
    pool.trim(table, 5)
    assert len(table) == 2 and pool.num_free_blocks == 14


def test_slots_follow_block_table():
    pool = make_pool(block=4)
    table = [3, 1]
    assert pool.slots(table, 2, 7).tolist() == [14, 15, 4, 5, 6]


def test_random_allocate_trim_free_leaves_pool_as_it_started():
    pool = make_pool(tokens=256, block=4)
    rng = random.Random(0)
    tables = [[] for _ in range(10)]
    for _ in range(2000):
        t = rng.choice(tables)
        op = rng.random()
        if op < 0.5:
            pool.reserve(t, len(t) * 4 + rng.randint(1, 9))
        elif op < 0.8:
            pool.trim(t, rng.randint(0, len(t) * 4))
        else:
            pool.free(t)
        owned = [b for tb in tables for b in tb]
        assert len(owned) == len(set(owned)) and len(owned) + pool.num_free_blocks == pool.num_blocks
    for t in tables:
        pool.free(t)
    assert pool.num_free_blocks == pool.num_blocks and pool.usage == 0.0


# Layer groups: sliding-window layers hand their KV back as the window moves.
GEMMA3_WINDOWS = ([512] * 5 + [None]) * 3  # 18 layers, 5 local to 1 global


def windowed_pool(tokens=64, block=4, windows=(8, None)):
    return KVPool(2 if len(windows) == 2 else len(windows), 2, 4, tokens, block, torch.float32, "cpu", windows=list(windows))


def test_layers_are_grouped_by_window_in_groups_of_one_size_full_attention_first():
    groups, width = plan_groups(GEMMA3_WINDOWS)
    assert width == 3 and len(groups) == 6
    assert groups[0] == LayerGroup(None, (5, 11, 17))
    assert all(g.window == 512 and len(g.layers) == 3 for g in groups[1:])
    assert sorted(layer for g in groups for layer in g.layers) == list(range(18))
    assert plan_groups([None, None]) == ([LayerGroup(None, (0, 1))], 2)
    groups, width = plan_groups([4, None, 4, 4])  # 3 windowed layers in groups of 1
    assert width == 1 and [g.window for g in groups] == [None, 4, 4, 4]


def test_a_pool_without_windows_is_a_plain_pool():
    pool = make_pool(tokens=64, block=4)
    assert len(pool.groups) == 1 and pool.num_blocks == 16 and pool.capacity == 64 and not pool.windowed


def test_blocks_hold_one_layer_slot_per_group_member_and_layers_share_slots_across_groups():
    pool = KVPool(18, 1, 8, 96, 16, torch.float32, "cpu", windows=GEMMA3_WINDOWS)
    # The memory of 96 positions of 18 layers, in blocks of 3 layers: 6x the blocks.
    assert pool.width == 3 and pool.num_blocks == 96 * 18 // (3 * 16)
    assert pool.keys[5] is pool.keys[0] and pool.keys[5] is not pool.keys[11]
    assert pool.group_of[5] == 0 and pool.group_of[0] == 1 and pool.group_of[4] == 2


def test_a_windowed_group_drops_the_blocks_behind_the_window_of_the_next_position_fed():
    pool = windowed_pool(tokens=64, block=4, windows=(8, None))  # 2 groups of 1 layer: 32 blocks
    table = pool.new_table()
    assert pool.reserve(table, 10, start=0)
    full, window = pool.tables(table)
    assert len(full) == len(window) == 3 and pool.num_free_blocks == 32 - 6
    # Feeding position 20 on: keys from 13 on are read, so blocks 0..2 (positions 0..11) go.
    assert pool.reserve(table, 21, start=20)
    assert len(full) == 6 and window[:3] == [NO_BLOCK] * 3 and NO_BLOCK not in window[3:]
    assert pool.num_free_blocks == 32 - 6 - 3
    assert pool.slots(table, 12, 14, group=1).tolist() == [window[3] * 4, window[3] * 4 + 1]
    assert pool.slots(table, 0, 1, group=1).tolist() == [0]  # dropped: never read
    pool.trim(table, 17)
    assert len(window) == 5 and pool.num_free_blocks == 32 - 5 - 2
    pool.free(table)
    assert pool.num_free_blocks == 32 and table == [] and pool.tables(table)[1] == []


def test_a_fresh_table_starting_past_the_window_allocates_only_the_window():
    pool = windowed_pool(tokens=64, block=4, windows=(8, None))
    table = pool.new_table()
    assert pool.reserve(table, 30, start=29)
    full, window = pool.tables(table)
    assert len(full) == 8 and window == [NO_BLOCK] * 5 + window[5:] and len(window) == 8
    assert pool.num_free_blocks == 32 - 8 - 3


def test_room_counts_what_the_window_hands_back_and_every_group():
    pool = windowed_pool(tokens=32, block=4, windows=(8, None))  # 16 blocks
    table = pool.new_table()
    assert pool.reserve(table, 24)  # 6 + 6 blocks held, 4 free
    # From position 24 the window group keeps blocks 4, 5: 4 come back; 8 free, shared by both groups.
    room = pool.room(table, 24)
    assert room == 40  # 4 more blocks each
    assert pool.reserve(table, room, start=24) and not pool.reserve(table, room + 1, start=24)


def test_reserve_is_all_or_nothing_across_groups():
    pool = windowed_pool(tokens=16, block=4, windows=(8, None))  # 8 blocks
    a, b = pool.new_table(), pool.new_table()
    assert pool.reserve(a, 12)  # 3 + 3
    assert not pool.reserve(b, 8)  # needs 2 + 2, 2 free
    assert b == [] and pool.tables(b)[1] == [] and pool.num_free_blocks == 2


def test_a_plain_list_is_refused_by_a_pool_with_several_groups():
    with pytest.raises(TypeError, match="BlockTable"):
        windowed_pool().reserve([], 4)


def test_random_windowed_reserve_trim_free_leaves_pool_as_it_started():
    pool = KVPool(4, 2, 4, 256, 4, torch.float32, "cpu", windows=[6, None, 6, 6])
    rng = random.Random(0)
    tables = [pool.new_table() for _ in range(8)]
    starts = [0] * 8
    for _ in range(2000):
        i = rng.randrange(8)
        t = tables[i]
        op = rng.random()
        if op < 0.5:
            starts[i] = min(starts[i] + rng.randint(0, 6), len(t) * 4)
            pool.reserve(t, max(starts[i], len(t) * 4) + rng.randint(1, 9), start=starts[i])
        elif op < 0.8:
            starts[i] = min(starts[i], rng.randint(starts[i], max(starts[i], len(t) * 4)))
            pool.trim(t, max(starts[i], len(t) * 4 - rng.randint(0, 8)))
        else:
            pool.free(t)
            starts[i] = 0
        owned = [b for tb in tables for g in pool.tables(tb) for b in g if b != NO_BLOCK]
        assert len(owned) == len(set(owned)) and len(owned) + pool.num_free_blocks == pool.num_blocks
        for g, blocks in enumerate(pool.tables(t)):  # a windowed group never holds past its window
            if pool.groups[g].window is not None:
                assert all(b == NO_BLOCK for b in blocks[: pool.first_kept(g, starts[i])])
    for t in tables:
        pool.free(t)
    assert pool.num_free_blocks == pool.num_blocks and pool.usage == 0.0


def _resident_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="resident memory is read from Linux's /proc")
def test_a_pool_takes_resident_memory_as_its_blocks_are_written():
    """A pool sized for many long sequences holds resident only the blocks sequences have written; the
    rest reads as zeros."""
    before = _resident_mib()
    pool = KVPool(num_layers=4, num_kv_heads=4, head_dim=64, num_tokens=2**16, block_size=16, dtype=torch.float32, device="cpu")
    size = sum(t.nbytes for t in {id(t): t for t in pool.keys + pool.values}.values()) / 2**20
    assert size == 512 and _resident_mib() - before < 64
    table: list[int] = []
    assert pool.reserve(table, 64)
    for keys in pool.keys:
        keys[: 64 * 4].fill_(1.0)  # rows of the first blocks
    assert _resident_mib() - before < 64 and float(pool.values[0].abs().max()) == 0.0
