"""Partitioning, ShardedSampler (order, resume) and EvalSampler, single- and multi-process."""

import itertools
import math
import random
from collections import Counter

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import ddptrain
from ddptrain.data import (
    DataPartitioner,
    EvalSampler,
    ShardedSampler,
    eval_shard,
    global_order,
    mnist,
    partition_indices,
)
from support.idx_files import MNIST_ROOT, MNIST_TEST_LABEL_COUNTS


def _tutorial_partitions(n, sizes, seed):
    """The PyTorch distributed tutorial's DataPartitioner, as the oracle."""
    rng = random.Random()
    rng.seed(seed)
    indexes = list(range(n))
    rng.shuffle(indexes)
    parts = []
    for frac in sizes:
        part_len = int(frac * n)
        parts.append(indexes[0:part_len])
        indexes = indexes[part_len:]
    return parts


def _random_fractions(rng, k):
    weights = [rng.random() + 0.01 for _ in range(k)]
    return [w / sum(weights) for w in weights]


def test_partitions_cover_every_index_once_when_sizes_sum_to_one():
    """Fractions summing to 1 (even with float error) assign each index to exactly one part."""
    rng = random.Random(0)
    for n in [*range(0, 40), 97, 1000, 60000]:
        for sizes in [[1.0], [0.7, 0.2, 0.1], *([1 / w] * w for w in range(2, 10))]:
            sizes_list = [sizes, _random_fractions(rng, rng.randint(1, 7))]
            for s in sizes_list:
                parts = partition_indices(n, s, seed=n)
                assert sorted(itertools.chain(*parts)) == list(range(n)), (n, s)
                for part, frac in zip(parts, s, strict=True):
                    assert abs(len(part) - frac * n) <= 1, (n, s)


def test_partitions_are_disjoint_and_leave_the_rest_when_sizes_sum_below_one():
    """Fractions summing below 1 give disjoint parts of the requested sizes; the rest is unused."""
    for n in [0, 1, 9, 100, 1001]:
        parts = partition_indices(n, [0.25, 0.25], seed=3)
        flat = list(itertools.chain(*parts))
        assert len(flat) == len(set(flat)) and set(flat) <= set(range(n))
        assert all(abs(len(p) - n / 4) <= 1 for p in parts)


def test_partitions_equal_the_tutorials_when_fractions_divide_n():
    """Oracle: where int(frac * n) loses nothing, the parts are the tutorial's, seed for seed."""
    for n, sizes, seed in [
        (100, [0.7, 0.2, 0.1], 1234),
        (60000, [0.5, 0.5], 1234),
        (60000, [0.25] * 4, 7),
        (10, [0.5, 0.5], 0),
    ]:
        assert partition_indices(n, sizes, seed) == _tutorial_partitions(n, sizes, seed)


def test_partitions_are_deterministic_from_the_seed():
    """The same seed gives the same parts; another seed gives others."""
    assert partition_indices(500, [0.5, 0.5], seed=1) == partition_indices(500, [0.5, 0.5], seed=1)
    assert partition_indices(500, [0.5, 0.5], seed=1) != partition_indices(500, [0.5, 0.5], seed=2)


@pytest.mark.parametrize("sizes", [[0.6, 0.6], [1.5], [-0.1, 0.5], []])
def test_sizes_that_do_not_sum_to_at_most_one_are_a_clear_error(sizes):
    """Over-full, negative or empty sizes raise, quoting the sizes and their sum."""
    with pytest.raises(ValueError, match=r"summing to at most 1, got .*\(sum"):
        partition_indices(10, sizes)


def test_data_partitioner_use_returns_a_dataset_over_its_part():
    """use(i) is the i-th part as a dataset; an index past the last part is an IndexError."""
    data = [f"sample{i}" for i in range(10)]
    partitioner = DataPartitioner(data, sizes=[0.5, 0.5], seed=1234)
    expected = partition_indices(10, [0.5, 0.5], seed=1234)
    for i in range(2):
        part = partitioner.use(i)
        assert len(part) == 5
        assert [part[j] for j in range(len(part))] == [data[k] for k in expected[i]]
    with pytest.raises(IndexError, match="there are 2"):
        partitioner.use(2)


def _rank_streams(n, G, world_size, **kwargs):
    return [
        list(ShardedSampler(n, global_batch_size=G, rank=r, world_size=world_size, **kwargs))
        for r in range(world_size)
    ]


def _global_batches(streams, per_rank):
    """Union of the ranks' k-th batches, as sorted lists, for every k."""
    chunks = [[s[i : i + per_rank] for i in range(0, len(s), per_rank)] for s in streams]
    assert len({len(c) for c in chunks}) == 1, "ranks disagree on the number of batches"
    return [sorted(itertools.chain(*batch)) for batch in zip(*chunks, strict=True)]


def test_sampler_epoch_covers_every_index_once_across_ranks():
    """Over many (n, world_size, batch) an epoch yields each index once, bar padding or drop."""
    for n, world_size, per_rank, drop_last in itertools.product(
        [1, 2, 7, 10, 33, 64, 101], [1, 2, 3, 4, 8], [1, 3, 16], [False, True]
    ):
        G = per_rank * world_size
        if drop_last and n < G:
            continue
        streams = _rank_streams(n, G, world_size, drop_last=drop_last, seed=n)
        counts = Counter(itertools.chain(*streams))
        if drop_last:
            assert sum(counts.values()) == n // G * G and max(counts.values()) == 1
        else:
            assert set(counts) == set(range(n))
            assert sum(counts.values()) == math.ceil(n / G) * G
            assert sum(c - 1 for c in counts.values()) == -n % G, "only padding repeats"
        assert {len(s) for s in streams} == {len(streams[0])}


def test_kth_global_batch_is_the_same_at_every_world_size():
    """The union of the ranks' k-th batches is order[kG:(k+1)G] whatever the world size."""
    for n, G, drop_last in [(100, 12, False), (100, 12, True), (7, 12, False), (120, 24, False)]:
        order = global_order(n, G, epoch=0, seed=5, drop_last=drop_last)
        expected = [sorted(order[k : k + G]) for k in range(0, len(order), G)]
        for world_size in [w for w in range(1, G + 1) if G % w == 0]:
            streams = _rank_streams(n, G, world_size, seed=5, drop_last=drop_last)
            assert _global_batches(streams, G // world_size) == expected, (n, G, world_size)


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("drop_last", [False, True])
def test_index_order_equals_distributed_sampler(shuffle, drop_last):
    """Oracle: each rank's stream equals DistributedSampler's wherever the two overlap."""
    # A partial global batch: padding extends their stream, dropping whole batches shortens it.
    for n, world_size, per_rank, epoch, seed in itertools.product(
        [48, 50, 96, 101], [1, 2, 3, 4], [4, 8], [0, 3], [0, 42]
    ):
        G = world_size * per_rank
        dataset = range(n)
        for rank in range(world_size):
            ours = ShardedSampler(
                n,
                global_batch_size=G,
                rank=rank,
                world_size=world_size,
                shuffle=shuffle,
                seed=seed,
                drop_last=drop_last,
            )
            theirs = DistributedSampler(
                dataset,
                num_replicas=world_size,
                rank=rank,
                shuffle=shuffle,
                seed=seed,
                drop_last=drop_last,
            )
            ours.set_epoch(epoch)
            theirs.set_epoch(epoch)
            a, b = list(ours), list(theirs)
            if n % G == 0:
                assert a == b
            elif drop_last:
                assert a == b[: len(a)]
            else:
                assert a[: len(b)] == b


def test_non_divisible_global_batch_is_an_error_naming_valid_choices():
    """global_batch_size must split evenly over ranks; the error offers the nearest multiples."""
    with pytest.raises(ValueError, match="use a multiple of 3, such as 99 or 102"):
        ShardedSampler(1000, global_batch_size=100, rank=0, world_size=3)
    with pytest.raises(ValueError, match="use a multiple of 4, such as 4"):
        ShardedSampler(1000, global_batch_size=2, rank=0, world_size=4)


def _train_steps(samplers, loaders_iters, steps):
    """Draw `steps` batches on every rank, marking each consumed; return the samples seen."""
    seen = []
    for _ in range(steps):
        for sampler, it in zip(samplers, loaders_iters, strict=True):
            seen.extend(next(it)[0].tolist())
            sampler.mark_consumed()
    return seen


def _make_rank_loaders(n, G, world_size, **kwargs):
    dataset = TensorDataset(torch.arange(n))
    samplers = [
        ShardedSampler(n, global_batch_size=G, rank=r, world_size=world_size, **kwargs)
        for r in range(world_size)
    ]
    loaders = [DataLoader(dataset, batch_size=s.per_rank_batch_size, sampler=s) for s in samplers]
    return samplers, loaders


@pytest.mark.parametrize(
    "world_before, world_after", [(2, 2), (2, 4), (4, 2), (3, 1), (1, 6), (6, 3)]
)
@pytest.mark.parametrize("drop_last, shuffle", [(False, True), (True, True), (False, False)])
def test_resume_mid_epoch_yields_exactly_the_unseen_samples(
    world_before, world_after, drop_last, shuffle
):
    """Resuming from state_dict, at the same or another world size, sees only what was unseen."""
    # The loaders run ahead of training (as prefetching does); only marked batches count.
    n, G, epoch, steps = 101, 12, 2, 3
    kwargs = {"drop_last": drop_last, "shuffle": shuffle, "seed": 9}
    samplers, loaders = _make_rank_loaders(n, G, world_before, **kwargs)
    for s in samplers:
        s.set_epoch(epoch)
    iters = [iter(loader) for loader in loaders]
    seen = _train_steps(samplers, iters, steps)
    for it in iters:
        next(it)  # prefetched, never trained on
    states = [s.state_dict() for s in samplers]
    assert all(st == states[0] for st in states)
    assert states[0]["consumed_samples"] == steps * G

    resumed, loaders = _make_rank_loaders(n, G, world_after, **kwargs)
    for s in resumed:
        s.load_state_dict(states[0])
        s.set_epoch(epoch)  # the same epoch: must keep the position
    remaining = [[x.tolist() for (x,) in loader] for loader in loaders]
    rest = list(itertools.chain(*itertools.chain(*remaining)))

    order = global_order(n, G, epoch=epoch, **kwargs)
    assert Counter(seen) + Counter(rest) == Counter(order)
    assert sorted(seen) == sorted(order[: steps * G])
    expected_batches = [sorted(order[k : k + G]) for k in range(steps * G, len(order), G)]
    assert _global_batches([list(itertools.chain(*r)) for r in remaining], G // world_after) == (
        expected_batches
    )
    assert all(s.num_batches == len(expected_batches) for s in resumed)


def test_set_epoch_keeps_the_position_in_the_same_epoch_and_resets_it_in_a_new_one():
    """set_epoch(current) is a no-op (so resume works); set_epoch(other) starts at batch 0."""
    s = ShardedSampler(100, global_batch_size=10, rank=1, world_size=2)
    s.set_epoch(4)
    s.mark_consumed(3)
    s.set_epoch(4)
    assert s.consumed_samples == 30 and s.num_batches == 7 and len(s) == 35
    assert list(s) == global_order(100, 10, epoch=4)[31::2]
    s.set_epoch(5)
    assert s.consumed_samples == 0 and s.num_batches == s.batches_per_epoch == 10


def test_mark_consumed_past_the_end_of_the_epoch_is_an_error():
    """Marking more batches than the epoch has left says to call set_epoch for the next epoch."""
    s = ShardedSampler(25, global_batch_size=10, rank=0, world_size=1)
    s.mark_consumed(3)
    assert s.num_batches == 0 and len(s) == 0 and list(s) == []
    with pytest.raises(RuntimeError, match=r"call set_epoch\(1\)"):
        s.mark_consumed()


def test_load_state_dict_rejects_settings_that_change_the_order():
    """A checkpoint from another global batch size or seed is refused with the fix named."""
    state = ShardedSampler(100, global_batch_size=8, rank=0, world_size=2).state_dict()
    with pytest.raises(ValueError, match="global_batch_size=8 to resume"):
        ShardedSampler(100, global_batch_size=16, rank=0, world_size=2).load_state_dict(state)
    with pytest.raises(ValueError, match="seed=0 to resume"):
        ShardedSampler(100, global_batch_size=8, seed=1, world_size=1).load_state_dict(state)
    with pytest.raises(ValueError, match="whole number of global batches"):
        ShardedSampler(100, global_batch_size=8).load_state_dict({**state, "consumed_samples": 5})


def test_data_loader_with_per_rank_batch_size_gives_per_rank_batches():
    """DataLoader(batch_size=per_rank_batch_size, sampler=...) yields num_batches full batches."""
    s = ShardedSampler(50, global_batch_size=8, rank=3, world_size=4)
    loader = DataLoader(
        TensorDataset(torch.arange(50)), batch_size=s.per_rank_batch_size, sampler=s
    )
    sizes = [len(x) for (x,) in loader]
    assert len(loader) == s.num_batches == s.batches_per_epoch == 7
    assert sizes == [2] * 7


def _run_sharded_sampler_under_process_group(n, G):
    info = ddptrain.init_distributed()
    sampler = ShardedSampler(n, global_batch_size=G, seed=3)
    loader = DataLoader(
        TensorDataset(torch.arange(n)), batch_size=sampler.per_rank_batch_size, sampler=sampler
    )
    batches = []
    for (x,) in loader:
        gathered = [None] * info.world_size
        torch.distributed.all_gather_object(gathered, x.tolist())
        batches.append(sorted(itertools.chain(*gathered)))
    return sampler.rank, sampler.world_size, batches


def _run_eval_on_mnist_test_split(root):
    ddptrain.init_distributed()
    dataset = mnist(root, train=False)
    loader = DataLoader(dataset, batch_size=1000, sampler=EvalSampler(len(dataset)))
    counts = torch.zeros(10, dtype=torch.int64)
    for _, y in loader:
        counts += torch.bincount(y, minlength=10)
    return ddptrain.all_reduce_sum(counts).tolist()


def test_sampler_takes_rank_and_world_size_from_the_process_group():
    """Under 2 processes each rank's batches union to the world-size-1 global batches."""
    n, G = 37, 8
    results = ddptrain.spawn(_run_sharded_sampler_under_process_group, 2, n, G, timeout_s=120)
    assert [(r, w) for r, w, _ in results] == [(0, 2), (1, 2)]
    one_rank = ShardedSampler(n, global_batch_size=G, seed=3, rank=0, world_size=1)
    expected = _global_batches([list(one_rank)], G)
    assert results[0][2] == results[1][2] == expected


def test_eval_shards_cover_every_index_exactly_once():
    """Over many (n, world_size) the shards, in rank order, are range(n); sizes differ by <= 1."""
    for n, world_size in itertools.product(range(0, 60), range(1, 10)):
        shards = [eval_shard(n, r, world_size) for r in range(world_size)]
        assert list(itertools.chain(*shards)) == list(range(n))
        assert max(map(len, shards)) - min(map(len, shards)) <= 1
    assert sum(len(EvalSampler(10_000, rank=r, world_size=7)) for r in range(7)) == 10_000


@pytest.mark.skipif(not MNIST_ROOT.is_dir(), reason=f"shared MNIST not found at {MNIST_ROOT}")
def test_mnist_test_split_is_scored_on_exactly_10000_samples_across_3_ranks():
    """3 ranks with EvalSampler count every test sample once: the known label counts, 10,000."""
    results = ddptrain.spawn(_run_eval_on_mnist_test_split, 3, str(MNIST_ROOT), timeout_s=120)
    assert results[0] == results[1] == results[2] == MNIST_TEST_LABEL_COUNTS
    assert sum(results[0]) == 10_000
