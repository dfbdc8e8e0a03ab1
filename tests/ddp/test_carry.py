"""Reducer.carry / carried: a value summed over ranks with the next synchronized reduction,
with no collective of its own, through every kind of reduction the wrapper has.

One spawned world of 2 ranks runs every case (worlds.run_cases); a world of one runs here.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

import ddptrain
from ddptrain.comm import named_hook
from ddptrain.ddp.wrapper import DistributedDataParallel
from support import toy_models, worlds

WORLD_TIMEOUT_S = 300
pytestmark = pytest.mark.timeout(WORLD_TIMEOUT_S + 60)

# How each case reduces: ddptrain's transports (the last bucket's tail) or a torch hook
# (the used-flags all_reduce).
HOOKS = ("default", "allreduce", "bf16", "torch_allreduce")


def _wrap(hook: str) -> DistributedDataParallel:
    torch.manual_seed(0)
    base = toy_models.make("branch")
    if hook == "torch_allreduce":
        model = DistributedDataParallel(base)
        model.register_comm_hook(None, default_hooks.allreduce_hook)
        return model
    return DistributedDataParallel(base, comm_hook=None if hook == "default" else named_hook(hook))


def _backward(model: DistributedDataParallel, step: int, rank: int) -> None:
    x, y = toy_models.batch("branch", step, rank)
    toy_models.loss_of("branch", model, x, y, rank).backward()


def _record_collectives() -> list:
    """The `group` argument of each collective called from now on (None: the default group)."""
    calls: list = []
    for name in ("all_reduce", "broadcast", "all_gather", "barrier"):
        original = getattr(dist, name)

        def spy(*args, _original=original, **kwargs):
            calls.append(kwargs.get("group"))
            return _original(*args, **kwargs)

        setattr(dist, name, spy)
    return calls


def _case_flags(info) -> dict:
    out = {}
    for hook in HOOKS:
        model = _wrap(hook)
        seen = []
        # Step 0 also rebuilds the buckets in ready order: the value must survive that too.
        for step, value in enumerate([info.rank + 1, 0, 5 * (info.rank == 1), 3]):
            model.reducer.carry(value)
            before = model.reducer.carried
            if step == 3:
                with model.no_sync():
                    _backward(model, step, info.rank)
                after_no_sync = model.reducer.carried
            _backward(model, step, info.rank)
            seen.append((before, model.reducer.carried))
        out[hook] = {"seen": seen, "after_no_sync": after_no_sync}
    return out


def _case_no_extra_collective(info) -> dict:
    model = _wrap("allreduce")  # its buckets go over a group of its own, not the default one
    _backward(model, 0, info.rank)  # the first backward broadcasts the bucket order: not counted
    dist.barrier()
    calls = _record_collectives()
    model.reducer.carry(1)
    _backward(model, 1, info.rank)
    transport_group = model.comm_hook[0].group
    return {
        "other_groups": [g for g in calls if g is not transport_group],
        "buckets": len(model.bucket_sizes_bytes),
        "reductions": len(calls),
        "flag": model.reducer.carried,
    }


def _case_torch_hook_collectives(info) -> dict:
    out = {}
    for how in ("registered", "given"):
        torch.manual_seed(0)
        base = toy_models.make("batchnorm")
        hook = (None, default_hooks.allreduce_hook)
        if how == "registered":
            model = DistributedDataParallel(base)
            model.register_comm_hook(*hook)
        else:
            model = DistributedDataParallel(base, comm_hook=hook)
        x = torch.randn(8, 1, 28, 28, generator=torch.Generator().manual_seed(info.rank))
        model(x).sum().backward()  # the first backward broadcasts the bucket order: not counted
        dist.barrier()
        calls = _record_collectives()
        model.reducer.carry(info.rank + 1)
        model(x).sum().backward()
        out[how] = {
            "backend": len(calls),
            "buckets": len(model.bucket_sizes_bytes),
            "flag": model.reducer.carried,
            "grads": all(p.grad is not None for p in model.parameters()),
        }
        for name in ("all_reduce", "broadcast", "all_gather", "barrier"):
            setattr(dist, name, getattr(dist.distributed_c10d, name))
    return out


world = worlds.fixture(
    {
        "flags": _case_flags,
        "no_extra_collective": _case_no_extra_collective,
        "torch_hook_collectives": _case_torch_hook_collectives,
    },
    {2: ["flags", "no_extra_collective", "torch_hook_collectives"]},
    timeout_s=WORLD_TIMEOUT_S,
    setup=worlds.share_small_buckets,
)


@pytest.mark.parametrize("hook", HOOKS)
def test_carried_values_arrive_summed_over_ranks_after_the_backward(world, hook):
    """Each synced backward sums the values carried before it over ranks; no_sync carries none."""
    for rank_result in worlds.outcome(world(2), "flags"):
        r = rank_result[hook]
        assert r["seen"] == [(None, 1 + 2), (None, 0), (None, 5), (None, 3 + 3)]
        assert r["after_no_sync"] is None


def test_the_carried_value_rides_the_reduction_without_a_collective_of_its_own(world):
    """A carrying backward adds no collective: the value rides the last bucket's tail."""
    for r in worlds.outcome(world(2), "no_extra_collective"):
        assert r["other_groups"] == [] and r["reductions"] == r["buckets"]
        assert r["flag"] == 2


def test_beside_a_torch_hook_the_flags_and_buffers_skip_the_backend(world):
    """With a torch hook, registered or given, the backend sees only its one call per bucket."""
    # The used flags, the carried value and rank 0's buffers go through the default transport
    # kept beside the hook.
    for r in worlds.outcome(world(2), "torch_hook_collectives"):
        for how in ("registered", "given"):
            assert r[how]["backend"] == r[how]["buckets"], how
            assert r[how]["flag"] == 1 + 2 and r[how]["grads"], how


def test_a_world_of_one_returns_its_own_value(tmp_path, monkeypatch):
    """At world size 1 the carried value comes back as given, via a transport or a torch hook."""
    monkeypatch.setenv("DDPTRAIN_INIT_METHOD", f"file://{tmp_path / 'store'}")
    ddptrain.init_distributed(backend="gloo")
    for hook in ("default", "torch_allreduce"):
        model = _wrap(hook)
        model.reducer.carry(7)
        _backward(model, 0, 0)
        assert model.reducer.carried == 7
