"""The stored responses of /v1/responses: bounded per API key in count, bytes and age."""

from __future__ import annotations

from gateway.response_store import ResponseStore


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def body(n: int, size: int = 10) -> dict:
    return {"id": f"resp_{n}", "text": "x" * size}


def test_each_key_has_its_own_shelf_and_sees_no_other():
    store = ResponseStore(max_count=2, max_bytes=10_000, max_age=60)
    alice, bob = ResponseStore.owner(b"alice"), ResponseStore.owner(b"bob")
    assert alice != bob and ResponseStore.owner(None) == ""
    store.put(alice, "r1", body(1), [])
    assert store.get(bob, "r1") is None and store.get(alice, "r1").body == body(1)
    assert not store.delete(bob, "r1") and store.get(alice, "r1") is not None


def test_count_and_bytes_drop_the_keys_oldest_first():
    store = ResponseStore(max_count=2, max_bytes=200, max_age=60)
    alice, bob = "a", "b"
    store.put(bob, "b1", body(0), [])
    for n in range(3):
        store.put(alice, f"r{n}", body(n), [{"role": "user", "content": "hi"}])
    assert store.get(alice, "r0") is None and store.get(alice, "r2") is not None and len(store) == 3
    store.put(alice, "big", body(9, size=120), [])  # over 200 bytes with r1 and r2: both go
    assert store.get(alice, "r1") is None and store.get(alice, "r2") is None and store.get(alice, "big")
    assert store.get(bob, "b1") is not None
    assert not store.put(alice, "huge", body(9, size=500), []) and store.get(alice, "big") is not None


def test_responses_expire_after_max_age():
    clock = Clock()
    store = ResponseStore(max_count=10, max_bytes=10_000, max_age=60, clock=clock)
    store.put("a", "r1", body(1), [])
    clock.now = 30
    store.put("a", "r2", body(2), [])
    clock.now = 61
    assert store.get("a", "r1") is None and store.get("a", "r2") is not None
    clock.now = 91
    assert store.get("a", "r2") is None and len(store) == 0


def test_zero_limits_store_nothing():
    store = ResponseStore(max_count=0, max_bytes=10_000, max_age=60)
    assert not store.put("a", "r1", body(1), []) and store.get("a", "r1") is None
