"""Where torch's DDP cannot be the oracle: torch's PowerSGD over many buckets, and torch's Join
with ZeRO optimizers, checked against what the maths says (replicas equal, zero-gradient steps).

On gloo official DDP aborts with several PowerSGD buckets, and leaves a joined rank its old
gradients for ZeRO to step on. One spawned world of 2 ranks runs them all (worlds.fixture).
"""

from __future__ import annotations

import functools
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch.distributed.algorithms.join import Join

import ddptrain
from support import worlds
from support.torch_programs import batch, hooked, mlp, params, powersgd

WORLD_SIZE = 2


def _case_powersgd_many_buckets(info) -> dict:
    """torch's PowerSGD over several buckets: official DDP's callbacks issue all_reduces
    concurrently on gloo (an abort); ddptrain runs buckets one at a time."""
    make = functools.partial(hooked, ddptrain.DDP, info.rank, powersgd)
    many = make(bucket_cap_mb=0.002)
    model = ddptrain.DDP(mlp(), bucket_cap_mb=0.002)
    return {"params": many, "buckets": len(model.bucket_sizes_bytes)}


def test_powersgd_runs_over_many_buckets(world):
    """PowerSGD with several buckets trains on gloo, replicas bitwise equal."""
    results = worlds.outcome(world(WORLD_SIZE), "powersgd_many_buckets")
    assert results[0]["buckets"] > 2
    for r in results:
        assert bool(torch.isfinite(r["params"]).all())
        assert torch.equal(r["params"], results[0]["params"])


def _zero_run(rank: int, batches: int, make_optimizer, join: bool, pad_to: int = 0, micro: int = 1):
    """Steps of `micro` batches each (all but the last under no_sync()); a step past
    `batches` adds zero gradients."""
    model = ddptrain.DDP(mlp())
    optimizer = make_optimizer(model.parameters())
    with Join([model, optimizer]) if join else nullcontext():
        for step in range(max(batches, pad_to)):
            for m in range(micro):
                x, y = batch(rank, micro * step + m)
                with model.no_sync() if m < micro - 1 else nullcontext():
                    loss = F.cross_entropy(model(x), y)
                    (loss if step < batches else loss * 0).backward()
            optimizer.step()
            optimizer.zero_grad()
    return params(model)


def _case_join_with_zero(info) -> dict:
    """Join([model, optimizer]) with ZeRO (ddptrain's and torch's): a joined rank keeps
    stepping its shard with the others' mean, as if it added zero gradients."""
    # Imported here: importing torch.distributed.optim warns that torch.jit.script is deprecated.
    from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero

    batches = [4, 7][info.rank]
    ours = functools.partial(ddptrain.ZeroRedundancyOptimizer, optimizer_class=torch.optim.AdamW)
    torchs = functools.partial(TorchZero, optimizer_class=torch.optim.AdamW)
    return {
        "ours": _zero_run(info.rank, batches, ours, join=True),
        "torch_zero": _zero_run(info.rank, batches, torchs, join=True),
        "padded": _zero_run(info.rank, batches, ours, join=False, pad_to=7),
        "accumulating": _zero_run(info.rank, batches, ours, join=True, micro=2),
        "accumulating_padded": _zero_run(info.rank, batches, ours, join=False, pad_to=7, micro=2),
    }


def test_join_with_zero_optimizers_equals_zero_gradient_steps(world):
    """Join with ddptrain's or torch's ZeRO, no_sync steps too, is bitwise zero-gradient steps."""
    for r in worlds.outcome(world(WORLD_SIZE), "join_with_zero"):
        assert torch.equal(r["ours"], r["padded"])
        assert torch.equal(r["torch_zero"], r["padded"])
        assert torch.equal(r["accumulating"], r["accumulating_padded"])


CASES = {
    "powersgd_many_buckets": _case_powersgd_many_buckets,
    "join_with_zero": _case_join_with_zero,
}
world = worlds.fixture(CASES, {WORLD_SIZE: list(CASES)}, timeout_s=300)
