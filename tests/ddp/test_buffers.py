"""When the wrapper sends rank 0's buffers: with the last bucket (norm statistics in training
mode) or before the forward (anything a forward may read), and what every rank holds after.

One spawned world of 2 ranks runs every case (worlds.run_cases). Each case records, through a
transport, the order in which buckets and buffer broadcasts start relative to the forward and
the backward.
"""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
import torch.distributed as dist
from torch import nn

from ddptrain.ddp.hooks import GradBucket, Transport, transport_hook
from ddptrain.ddp.replicas import ModelBuffers
from ddptrain.ddp.wrapper import DistributedDataParallel
from support import worlds

WORLD_TIMEOUT_S = 240
pytestmark = pytest.mark.timeout(WORLD_TIMEOUT_S + 60)
WORLD_SIZE = 2


class _Recorder(Transport):
    """The backend's all_reduce; notes each bucket and each buffer broadcast it is asked for."""

    def __init__(self) -> None:
        self.events: list[str] = []

    def reduce(self, bucket: GradBucket) -> None:
        self.events.append("bucket")
        dist.all_reduce(bucket.buffer())

    def broadcast(self, tensors, src) -> bool:
        self.events.append(f"buffers from {src}")
        return False  # the wrapper then broadcasts through the backend itself


class _Scaled(nn.Module):
    """A buffer the forward reads: the output depends on rank 0's `scale` at that forward."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.register_buffer("scale", torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * self.scale


def _norm_net() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 3))


def _step(model, hook: _Recorder, rank: int, seed: int, sync: bool = True) -> list[str]:
    """One forward and backward on this rank's batch; the events it caused, with markers."""
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(seed * 10 + rank))
    hook.events[:] = ["forward"]
    with nullcontext() if sync else model.no_sync():
        out = model(x)
        hook.events.append("backward")
        out.square().mean().backward()
    return list(hook.events)


def _rank0s(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    copies = [t.detach().clone() for t in tensors]
    for t in copies:
        dist.broadcast(t, src=0)
    return copies


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _case_norm_statistics(info) -> dict:
    torch.manual_seed(0)
    hook = _Recorder()
    model = DistributedDataParallel(_norm_net(), comm_hook=(hook, transport_hook))
    buffers = list(model.module.buffers())
    out = {"train": [], "no_sync": None, "eval": None, "frozen": None}
    for step in range(3):
        out["train"].append(_step(model, hook, info.rank, step))
    out["train_as_rank0"] = _same(buffers, _rank0s(buffers))
    # Moved by this rank's own batch and not sent: the synchronized backward sends them.
    out["no_sync"] = _step(model, hook, info.rank, 10, sync=False)
    out["no_sync_differs"] = not _same(buffers, _rank0s(buffers))
    out["after_no_sync"] = _step(model, hook, info.rank, 11)
    out["after_no_sync_as_rank0"] = _same(buffers, _rank0s(buffers))
    # A forward in eval mode reads the statistics: they come before it.
    model.eval()
    hook.events[:] = ["forward"]
    with torch.no_grad():
        model(torch.zeros(2, 4))
    out["eval"] = list(hook.events)
    # A frozen norm layer in a training model reads them too.
    model.train()
    model.module[1].eval()
    out["frozen"] = _step(model, hook, info.rank, 20)
    return out


def _case_read_buffer(info) -> dict:
    torch.manual_seed(0)
    hook = _Recorder()
    model = DistributedDataParallel(_Scaled(), comm_hook=(hook, transport_hook))
    # Only rank 0 changes the buffer; the next forward must compute with its value everywhere.
    if info.rank == 0:
        model.module.scale.fill_(3.0)
    events = _step(model, hook, info.rank, 0)
    x = torch.ones(1, 4)
    with torch.no_grad():
        expected = model.module.linear(x) * 3.0
        got = model(x)
    return {"events": events, "output_uses_rank0s": torch.equal(got, expected)}


CASES = {"norm_statistics": _case_norm_statistics, "read_buffer": _case_read_buffer}


world = worlds.fixture(CASES, {WORLD_SIZE: list(CASES)}, timeout_s=WORLD_TIMEOUT_S)


AFTER_BACKWARD = ["forward", "backward", "bucket", "buffers from 0"]
BEFORE_FORWARD = ["forward", "buffers from 0", "backward", "bucket"]


def test_norm_statistics_in_training_travel_with_the_last_bucket(world):
    """BatchNorm statistics in training start after the last bucket; ranks end on rank 0's."""
    for r in worlds.outcome(world(WORLD_SIZE), "norm_statistics"):
        assert r["train"] == [AFTER_BACKWARD] * 3
        assert r["train_as_rank0"]


def test_no_sync_sends_no_buffers_and_the_next_synchronized_step_does(world):
    """Under no_sync() nothing is sent; the next synchronized backward brings rank 0's."""
    results = worlds.outcome(world(WORLD_SIZE), "norm_statistics")
    for r in results:
        assert r["no_sync"] == ["forward", "backward"]
        assert r["after_no_sync"] == AFTER_BACKWARD
        assert r["after_no_sync_as_rank0"]
    # Each rank's own batch had moved its statistics, so the check above is not vacuous.
    assert results[1]["no_sync_differs"]


def test_forwards_that_read_statistics_get_them_before(world):
    """An eval forward, and a frozen (eval-mode) norm layer in training, get them first."""
    for r in worlds.outcome(world(WORLD_SIZE), "norm_statistics"):
        assert r["eval"] == ["forward", "buffers from 0"]
        assert r["frozen"] == BEFORE_FORWARD


def test_other_buffers_are_broadcast_before_the_forward_that_reads_them(world):
    """A buffer the forward reads reaches every rank before it: the output uses rank 0's."""
    for r in worlds.outcome(world(WORLD_SIZE), "read_buffer"):
        assert r["events"] == BEFORE_FORWARD
        assert r["output_uses_rank0s"]


def test_only_norm_statistics_in_training_mode_may_follow_the_gradients():
    """BatchNorm/InstanceNorm in training: yes; in eval mode, or beside another buffer: no."""

    def follows(module: nn.Module) -> bool:
        return ModelBuffers(module, process_group=None).follow_gradients()

    norms = nn.Sequential(nn.BatchNorm1d(4), nn.InstanceNorm1d(4, track_running_stats=True))
    assert follows(norms)
    norms[1].eval()
    assert not follows(norms)
    assert not follows(_Scaled())
    assert not follows(nn.Sequential(nn.BatchNorm1d(4), _Scaled()))
    assert not ModelBuffers(nn.Linear(2, 2), None)  # no buffers at all
