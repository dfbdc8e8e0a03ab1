"""BatchNorm statistics of the exact mode (ddp/micro_batches.py): gathered through a summed
region (the last bucket's tail) they end on the bits the all_gather gives."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from ddptrain.ddp.micro_batches import MicroBatchForwards
from ddptrain.models import LeNet


def test_statistics_summed_over_ranks_regions_equal_the_all_gathered_ones(tmp_path):
    """Statistics regions summed over 3 ranks equal one rank's gathered statistics bitwise."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/init", rank=0, world_size=1)
    torch.manual_seed(0)
    net = LeNet(width=1, batchnorm=True, dropout=0.2)
    start = copy.deepcopy(net.state_dict())
    g = torch.Generator().manual_seed(1)
    batches = [torch.randn(4, 1, 28, 28, generator=g) for _ in range(6)]

    # Built before any forward: each reads the run's seed, which seeding a forward moves.
    alone = MicroBatchForwards(net, None)
    world_size = 3
    ranks = []
    for rank in range(world_size):
        copy_of_net = LeNet(width=1, batchnorm=True, dropout=0.2)
        copy_of_net.load_state_dict(start)
        forwards = MicroBatchForwards(copy_of_net, None)
        forwards.rank, forwards.world_size = rank, world_size
        ranks.append((copy_of_net, forwards))

    for x in batches:
        net(x)
    alone.combine(len(batches))
    for rank, (copy_of_net, _) in enumerate(ranks):
        for x in batches[rank::world_size]:
            copy_of_net(x)
    n = ranks[0][1].record_numel
    regions = [torch.full((len(batches) * n + 5,), 7, dtype=torch.int64) for _ in ranks]
    assert all(f.write_records(r) for (_, f), r in zip(ranks, regions, strict=True))
    assert not ranks[2][1].write_records(torch.zeros(len(batches) * n - 1, dtype=torch.int64))
    total = sum(regions)
    combined, forwards = ranks[0]
    forwards.combine(len(batches), total[: len(batches) * n].view(torch.float64))

    assert n > 0
    for name, want in net.state_dict().items():
        if "running" in name or "num_batches" in name:
            assert torch.equal(combined.state_dict()[name], want), name
    assert not torch.equal(net.bn1.running_mean, start["bn1.running_mean"])
