"""The wrapper's buckets against official DDP at world size 2: rebuilt once in rank 0's
gradient-ready order (or kept, when asked), and `.grad` as a view into them or as a copy.

One spawned world runs every case of this module (worlds.run_cases).
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from ddptrain.ddp.wrapper import DistributedDataParallel
from support import toy_models, worlds

# A spawned world runs several cases, so its first test waits for all of them: generous bounds
# (a loaded 2-core machine runs it several times slower) that a hang still reaches.
WORLD_TIMEOUT_S = 300
pytestmark = pytest.mark.timeout(WORLD_TIMEOUT_S + 60)


class _UsedInReverse(torch.nn.Module):
    """Registers its layers in the reverse of the order forward uses them."""

    def __init__(self) -> None:
        super().__init__()
        self.second = torch.nn.Linear(8, 4)
        self.first = torch.nn.Linear(6, 8)
        self.side = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, use_side: bool) -> torch.Tensor:
        h = torch.relu(self.first(x))
        if use_side:
            h = h + self.side(h)
        return self.second(h)


def _rebuild(info, rebuild: bool) -> dict:
    torch.manual_seed(0)
    base = _UsedInReverse()
    # Tiny caps: one parameter per bucket, so bucket order is parameter order.
    caps = {"bucket_cap_mb": 1e-6, "first_bucket_cap_mb": 1e-6}
    ours = DistributedDataParallel(copy.deepcopy(base), rebuild_buckets=rebuild, **caps)
    theirs = TorchDDP(copy.deepcopy(base), find_unused_parameters=True)
    before = ours.bucket_param_names
    for model in (ours, theirs):
        opt = toy_models.sgd(model)
        for step in range(4):
            g = torch.Generator().manual_seed(10 * step + info.rank)
            opt.zero_grad()
            # Only rank 1 uses the side layer, so rank 0's ready order differs from rank 1's.
            model(torch.randn(5, 6, generator=g), use_side=info.rank == 1).pow(2).mean().backward()
            opt.step()
    pairs = zip(ours.parameters(), theirs.parameters(), strict=True)
    return {
        "before": before,
        "after": ours.bucket_param_names,
        "bitwise": all(torch.equal(a, b) for a, b in pairs),
    }


def _layers(buckets: list[list[str]]) -> list[str]:
    return [name.split(".")[0] for bucket in buckets for name in bucket]


def test_buckets_rebuilt_in_rank0_ready_order_after_first_backward(world):
    """The first backward's gradient-ready order (rank 0's) becomes the bucket order everywhere."""
    results = worlds.outcome(world(2), "rebuild_on")
    for r in results:
        assert _layers(r["before"]) == ["side", "side", "first", "first", "second", "second"]
        # second's gradients are ready first; rank 0 never uses side, so side goes last.
        assert _layers(r["after"]) == ["second", "second", "first", "first", "side", "side"]
        assert r["after"] == results[0]["after"]
        assert r["bitwise"]


def test_rebuild_can_be_turned_off(world):
    """rebuild_buckets=False keeps the reverse-registration bucket order."""
    for r in worlds.outcome(world(2), "rebuild_off"):
        assert r["after"] == r["before"]
        assert r["bitwise"]


def _view_modes(info, set_to_none: bool) -> dict:
    out = {}
    for name in ("lenet", "batchnorm"):
        torch.manual_seed(5)
        base = toy_models.make(name)
        runs = {
            "ours_view": DistributedDataParallel(copy.deepcopy(base)),
            "ours_copy": DistributedDataParallel(
                copy.deepcopy(base), gradient_as_bucket_view=False
            ),
            "theirs_view": TorchDDP(copy.deepcopy(base), gradient_as_bucket_view=True),
        }
        for model in runs.values():
            opt = toy_models.sgd(model)
            for step in range(5):
                x, y = toy_models.batch(name, step, info.rank)
                torch.manual_seed(step)
                opt.zero_grad(set_to_none=set_to_none)
                toy_models.loss_of(name, model, x, y, info.rank).backward()
                opt.step()
        flat = {k: toy_models.flat_params(m.module) for k, m in runs.items()}
        storages = {
            k: {p.grad.untyped_storage().data_ptr() for p in m.module.parameters()}
            for k, m in runs.items()
        }
        out[name] = {
            "view_equal": torch.equal(flat["ours_view"], flat["theirs_view"]),
            "copy_equal": torch.equal(flat["ours_copy"], flat["theirs_view"]),
            "view_storages": len(storages["ours_view"]),
            "copy_storages": len(storages["ours_copy"]),
            "n_buckets": len(runs["ours_view"].bucket_sizes_bytes),
        }
    return out


@pytest.mark.parametrize("set_to_none", [True, False])
def test_gradient_as_bucket_view_both_modes_bitwise_equal_official(world, set_to_none):
    """View and copy modes equal official DDP (gradient_as_bucket_view=True) bitwise at ws 2."""
    case = "view_modes_set_to_none" if set_to_none else "view_modes_zero"
    for r in worlds.outcome(world(2), case):
        for name, d in r.items():
            assert d["view_equal"] and d["copy_equal"], (name, d)
            # Views: grads live in the bucket buffers; copies: one storage per parameter.
            assert d["view_storages"] == d["n_buckets"], (name, d)
            assert d["copy_storages"] > d["n_buckets"], (name, d)


CASES = {
    "rebuild_on": functools.partial(_rebuild, rebuild=True),
    "rebuild_off": functools.partial(_rebuild, rebuild=False),
    "view_modes_set_to_none": functools.partial(_view_modes, set_to_none=True),
    "view_modes_zero": functools.partial(_view_modes, set_to_none=False),
}
CASES_BY_WORLD = {2: list(CASES)}


world = worlds.fixture(CASES, CASES_BY_WORLD, timeout_s=WORLD_TIMEOUT_S)
