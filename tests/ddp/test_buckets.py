"""Unit tests of the pure bucket assignment (no processes)."""

import random

import pytest

from ddptrain.ddp.buckets import MB, assign_buckets, mb_to_bytes


def test_every_index_in_exactly_one_bucket():
    """Across random sizes, keys and caps every index lands in exactly one bucket."""
    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(0, 40)
        sizes = [rng.randint(0, 5000) for _ in range(n)]
        keys = [rng.choice(["f32", "f16", "bf16"]) for _ in range(n)]
        buckets = assign_buckets(
            sizes, keys, cap_bytes=rng.randint(1, 20000), first_cap_bytes=rng.randint(1, 5000)
        )
        flat = sorted(i for b in buckets for i in b)
        assert flat == list(range(n))
        assert all(b for b in buckets)


def test_buckets_hold_one_key_and_keep_input_order():
    """A bucket never mixes keys, and indices inside it keep the given (ready) order."""
    keys = ["a", "b", "a", "b", "a"]
    buckets = assign_buckets([10] * 5, keys, cap_bytes=15, first_cap_bytes=15)
    for b in buckets:
        assert len({keys[i] for i in b}) == 1
        assert b == sorted(b)


def test_first_bucket_is_small_then_cap():
    """The first bucket per key closes at first_cap_bytes, later ones at cap_bytes."""
    buckets = assign_buckets([MB // 2] * 10, ["f32"] * 10, cap_bytes=2 * MB, first_cap_bytes=MB)
    assert buckets == [[0, 1], [2, 3, 4, 5], [6, 7, 8, 9]]


def test_closed_buckets_come_before_open_ones_in_ready_order():
    """Buckets are ordered by when they close, so launch order follows gradient readiness."""
    buckets = assign_buckets(
        [1, 100, 1, 100], ["x", "y", "x", "y"], cap_bytes=150, first_cap_bytes=150
    )
    assert buckets == [[1, 3], [0, 2]]


def test_a_tensor_larger_than_the_cap_gets_its_own_bucket():
    """A single oversized gradient forms a bucket by itself instead of being split."""
    assert assign_buckets([10, 1000, 10], ["f"] * 3, cap_bytes=100, first_cap_bytes=100) == [
        [0, 1],
        [2],
    ]


def test_invalid_arguments_are_refused():
    """Mismatched lengths and non-positive caps are errors, not silent misbehaviour."""
    with pytest.raises(ValueError):
        assign_buckets([1, 2], ["a"], cap_bytes=10)
    with pytest.raises(ValueError):
        assign_buckets([1], ["a"], cap_bytes=0)
    with pytest.raises(ValueError, match="bucket cap"):
        mb_to_bytes(0)
    assert mb_to_bytes(25) == 25 * MB
