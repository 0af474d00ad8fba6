"""KV pool: block allocation, all-or-nothing reservation, rollback by length, no leaks."""

import random

import torch

from specstream.kv import KVPool


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
