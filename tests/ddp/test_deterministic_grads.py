"""Where DDP(deterministic=True) leaves .grad: in its spent int64 slots, so the mode holds no
gradient beside its buckets, with the mean of the micro-batches' gradients, across bucket
rebuilds and with .grad kept between steps (zero_grad(set_to_none=False))."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ddptrain

pytestmark = pytest.mark.timeout(300)

MICRO, PER_RANK, STEPS, WORLD = 4, 3, 3, 2


def _net() -> nn.Module:
    torch.manual_seed(0)
    # BatchNorm: its statistics' room grows the buckets after the first step (a rebuild).
    return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))


def _micro_batch(step: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + k)
    return torch.randn(MICRO, 6, generator=g), torch.randint(0, 3, (MICRO,), generator=g)


def _reference_mean(net: nn.Module, step: int) -> list[torch.Tensor]:
    """The float64 mean over the step's micro-batches of their gradients, one at a time."""
    total = [torch.zeros_like(p, dtype=torch.float64) for p in net.parameters()]
    for k in range(PER_RANK * WORLD):
        net.zero_grad(set_to_none=True)
        x, y = _micro_batch(step, k)
        F.cross_entropy(net(x), y).backward()
        for t, p in zip(total, net.parameters(), strict=True):
            t += p.grad.double()
    return [t / (PER_RANK * WORLD) for t in total]


def _train(set_to_none: bool) -> dict:
    """STEPS steps of PER_RANK micro-batches a rank; per step, whether every .grad lies in a
    bucket and its largest error against the float64 mean of a single-process replay."""
    info = ddptrain.init_distributed()
    net = _net()
    replay = _net()
    model = ddptrain.DDP(net, deterministic=True)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    in_buckets, errors = [], []
    for step in range(STEPS):
        replay.load_state_dict(net.state_dict())
        want = _reference_mean(replay, step)
        for j in range(PER_RANK):
            sync = j == PER_RANK - 1
            with contextlib.nullcontext() if sync else model.no_sync():
                x, y = _micro_batch(step, j * info.world_size + info.rank)
                F.cross_entropy(model(x), y).backward()
        storages = {b.flat.untyped_storage().data_ptr() for b in model.reducer.buckets}
        grads = [p.grad for p in net.parameters()]
        in_buckets.append(all(g.untyped_storage().data_ptr() in storages for g in grads))
        errors.append(
            max(
                ((g.double() - w).abs().max() / w.abs().max()).item()
                for g, w in zip(grads, want, strict=True)
            )
        )
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
    params = [p.detach().clone() for p in net.parameters()]
    ddptrain.shutdown()
    return {"in_buckets": in_buckets, "errors": errors, "params": params}


def _both() -> dict:
    kept = _train(set_to_none=False)
    dropped = _train(set_to_none=True)
    return {"kept": kept, "dropped": dropped}


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    return ddptrain.spawn(_both, WORLD, timeout_s=240)


def test_every_grad_lies_in_its_bucket_after_each_step(runs):
    """Each .grad is a bucket view after every synced backward, the first (rebuilt) included."""
    for rank in runs:
        for run in rank.values():
            assert run["in_buckets"] == [True] * STEPS


def test_the_grads_are_the_micro_batches_mean(runs):
    """Each step's .grad is the ranks' micro-batch mean, within 1e-5 of a float64 replay."""
    for rank in runs:
        for run in rank.values():
            assert max(run["errors"]) < 1e-5, run["errors"]


def test_a_grad_kept_between_steps_gives_the_same_bits(runs):
    """zero_grad(set_to_none=False) ends on the same bits as set_to_none=True."""
    # The kept .grad stays in its slot, where autograd adds the next micro-batch.
    for rank in runs:
        kept, dropped = rank["kept"]["params"], rank["dropped"]["params"]
        assert all(torch.equal(a, b) for a, b in zip(kept, dropped, strict=True))


class _Branchy(nn.Module):
    """A layer every step uses and a branch only the steps marked `branch` take."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body, self.branch = nn.Linear(6, 3), nn.Linear(6, 3)
        self.take_branch = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x) + (self.branch(x) if self.take_branch else 0)


def _kept_branch_grad() -> dict:
    """Step 0 takes the branch, step 1 does not; no zero_grad between them."""
    info = ddptrain.init_distributed()
    net = _Branchy()
    model = ddptrain.DDP(net, deterministic=True)
    after = []
    for step in range(2):
        net.take_branch = step == 0
        for j in range(PER_RANK):
            with contextlib.nullcontext() if j == PER_RANK - 1 else model.no_sync():
                x, y = _micro_batch(step, j * info.world_size + info.rank)
                F.cross_entropy(model(x), y).backward()
        after.append(net.branch.weight.grad.clone())
    ddptrain.shutdown()
    return {"after": after}


def test_a_kept_grad_of_a_layer_the_next_step_skips_stays_as_it_was():
    """Without zero_grad, a layer the next step skips keeps its .grad, as under torch's DDP."""
    # That .grad lay in the slot the next step zeroes and sums into.
    for rank in ddptrain.spawn(_kept_branch_grad, WORLD, timeout_s=240):
        first, second = rank["after"]
        assert first.abs().sum() > 0
        assert torch.equal(first, second)
