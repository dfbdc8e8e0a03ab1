"""Programs written for torch's DDP run on ddptrain's with the import swapped, and end equal.

Each program below takes the wrapper class as its only difference (`DDP`), as a user swapping
`from torch.nn.parallel import DistributedDataParallel as DDP` for `from ddptrain import DDP`
would; torch's comm hooks, their wrappers and torch's Join run unchanged, and torch's arguments
err as on torch's. One spawned world of 2 ranks runs them all (worlds.fixture). Where torch's
DDP cannot be the oracle: tests/ddp/test_beyond_torch_ddp.py.
"""

from __future__ import annotations

import copy
import functools
import os
import tempfile
import warnings
from contextlib import nullcontext

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import (
    default_hooks,
    optimizer_overlap_hooks,
    powerSGD_hook,
)
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import ddptrain
from support import worlds
from support.torch_programs import STEPS, batch, hooked, mlp, params, powersgd

WORLD_SIZE = 2


class ToyModel(nn.Module):
    """The DDP tutorial's model."""

    def __init__(self) -> None:
        super().__init__()
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net2(self.relu(self.net1(x)))


# ------------------------------------------------------------------------------ programs
def tutorial_basic(DDP, rank: int) -> torch.Tensor:  # noqa: N803 - the class, as users name it
    """pytorch.org's DDP tutorial, demo_basic, on CPU: MSE loss, SGD (with static_graph)."""
    torch.manual_seed(rank)  # each rank its own weights: DDP must start from rank 0's
    model = ToyModel()
    ddp_model = DDP(model, static_graph=True)
    loss_fn = nn.MSELoss()
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=0.001)
    for step in range(STEPS):
        optimizer.zero_grad()
        outputs = ddp_model(torch.randn(20, 10, generator=torch.Generator().manual_seed(step)))
        labels = torch.randn(20, 5, generator=torch.Generator().manual_seed(step + rank))
        loss_fn(outputs, labels).backward()
        optimizer.step()
    return params(ddp_model)


def tutorial_checkpoint(DDP, rank: int) -> torch.Tensor:  # noqa: N803
    """The tutorial's demo_checkpoint: rank 0 saves ddp_model.state_dict(), all load it."""
    torch.manual_seed(rank)
    ddp_model = DDP(ToyModel())
    path = os.path.join(tempfile.gettempdir(), f"ddptrain-tutorial-{os.getppid()}.pt")
    if rank == 0:
        torch.save(ddp_model.state_dict(), path)
    dist.barrier()
    ddp_model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=0.001)
    x, y = batch(rank, 0, 10, 5)
    F.cross_entropy(ddp_model(x), y).backward()
    optimizer.step()
    dist.barrier()
    if rank == 0:
        os.remove(path)
    return params(ddp_model)


def positional_arguments(DDP, rank: int) -> torch.Tensor:  # noqa: N803
    """torch's arguments given positionally: device_ids, output_device, dim, broadcast_buffers,
    init_sync, process_group, bucket_cap_mb, find_unused_parameters (a branch left unused)."""
    model = mlp()
    ddp_model = DDP(model, None, None, 0, True, True, None, 0.001, True)
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=0.05, momentum=0.9)
    for step in range(STEPS):
        x, y = batch(rank, step)
        optimizer.zero_grad()
        F.cross_entropy(ddp_model(x), y).backward()
        optimizer.step()
    return params(ddp_model)


def accumulate_with_no_sync(DDP, rank: int) -> torch.Tensor:  # noqa: N803
    """Gradient accumulation over 3 micro-batches with no_sync()."""
    ddp_model = DDP(mlp(), bucket_cap_mb=0.002)
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=0.05, momentum=0.9)
    for step in range(STEPS):
        optimizer.zero_grad()
        for micro in range(3):
            x, y = batch(rank, 3 * step + micro)
            with ddp_model.no_sync() if micro < 2 else nullcontext():
                F.cross_entropy(ddp_model(x), y).backward()
        optimizer.step()
    return params(ddp_model)


def _allreduce():
    return None, default_hooks.allreduce_hook


def _fp16():
    return None, default_hooks.fp16_compress_hook


def _into_a_new_tensor():
    """A hook shaped like the encode/decode hooks of torch's docs: it reduces a tensor of its
    own and returns that one, leaving the bucket's buffer as it was."""

    def hook(state, bucket):
        encoded = bucket.buffer() / dist.get_world_size()
        future = dist.all_reduce(encoded, async_op=True).get_future()
        return future.then(lambda f: f.value()[0])

    return None, hook


def _sgd_in_the_hook():
    """torch's hook wrapper that steps a functional SGD on each bucket's parameters once the
    bucket is reduced (what DDP's _register_fused_optim registers)."""
    # Imported here: importing torch.distributed.optim warns that torch.jit.script is deprecated.
    from torch.distributed.optim.functional_sgd import _FunctionalSGD

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # TorchScript support, unused here
        sgd = _FunctionalSGD([], lr=0.1, momentum=0.9, _allow_empty_param_list=True)
    state = optimizer_overlap_hooks._OptimizerHookState(sgd)
    return None, optimizer_overlap_hooks._hook_then_optimizer(default_hooks.allreduce_hook, state)


def optimizer_in_the_hook(DDP, rank: int) -> torch.Tensor:  # noqa: N803
    """No optimizer.step(): the hook steps each bucket's parameters as its reduction ends."""
    ddp_model = DDP(mlp(), bucket_cap_mb=0.002)
    ddp_model.register_comm_hook(*_sgd_in_the_hook())
    for step in range(STEPS):
        x, y = batch(rank, step)
        F.cross_entropy(ddp_model(x), y).backward()
        ddp_model.zero_grad(set_to_none=True)
    return params(ddp_model)


def uneven_with_join(DDP, rank: int) -> torch.Tensor:  # noqa: N803
    """The join tutorial: model.join() with rank 1 holding 3 more batches."""
    ddp_model = DDP(mlp())
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=0.05)
    with ddp_model.join():
        for step in range(5 + 3 * rank):
            x, y = batch(rank, step)
            optimizer.zero_grad()
            F.cross_entropy(ddp_model(x), y).backward()
            optimizer.step()
    return params(ddp_model)


PROGRAMS = {
    "tutorial_basic": tutorial_basic,
    "tutorial_checkpoint": tutorial_checkpoint,
    "positional_arguments": positional_arguments,
    "accumulate_with_no_sync": accumulate_with_no_sync,
    "allreduce_hook": functools.partial(hooked, make_hook=_allreduce, bucket_cap_mb=0.002),
    "fp16_compress_hook": functools.partial(hooked, make_hook=_fp16, bucket_cap_mb=0.002),
    "hook_returning_a_new_tensor": functools.partial(
        hooked, make_hook=_into_a_new_tensor, bucket_cap_mb=0.002
    ),
    # One bucket: official DDP's PowerSGD crashes on gloo with several
    # (tests/ddp/test_beyond_torch_ddp.py).
    "powerSGD_hook": functools.partial(hooked, make_hook=powersgd, bucket_cap_mb=25),
    "uneven_with_join": uneven_with_join,
    "optimizer_in_the_hook": optimizer_in_the_hook,
}


def _case_programs(info) -> dict:
    out = {}
    for name, program in PROGRAMS.items():
        ours, theirs = program(ddptrain.DDP, info.rank), program(TorchDDP, info.rank)
        out[name] = {"bitwise": torch.equal(ours, theirs), "ours": ours}
    return out


@pytest.mark.parametrize("name", PROGRAMS)
def test_a_torch_ddp_program_ends_bitwise_equal_with_ddptrain(world, name):
    """A program ends on the same bits with torch's DDP and ddptrain's, on every rank alike."""
    results = worlds.outcome(world(WORLD_SIZE), "programs")
    for r in results:
        assert r[name]["bitwise"], name
        assert torch.equal(r[name]["ours"], results[0][name]["ours"])


# ------------------------------------------------------------------------------ hook wrappers
def _renamed(hook):
    """`hook` under another name: torch's DDP refuses the bf16 hooks by name off CUDA (a NCCL
    version check), while gloo sums bfloat16 on the CPU."""

    def hook_under_another_name(state, bucket):
        return hook(state, bucket)

    return hook_under_another_name


def _powersgd_wrapped(wrapper):
    def make():
        return powersgd()[0], wrapper(powerSGD_hook.powerSGD_hook)

    return make


# torch's wrappers of ddp_comm_hooks, around a hook: name -> (the dtype gradients travel in,
# (state, hook) maker, bucket_cap_mb). hook_with_zero_step(_interleaved) refuses gloo, so it
# has no CPU test; _hook_then_optimizer is a program above (optimizer_in_the_hook).
WRAPPERS = {
    "fp16_compress_wrapper(allreduce_hook)": (
        torch.float16,
        lambda: (None, default_hooks.fp16_compress_wrapper(default_hooks.allreduce_hook)),
        0.002,
    ),
    "bf16_compress_wrapper(allreduce_hook)": (
        torch.bfloat16,
        lambda: (None, _renamed(default_hooks.bf16_compress_wrapper(default_hooks.allreduce_hook))),
        0.002,
    ),
    # One bucket, as for powerSGD_hook above.
    "fp16_compress_wrapper(powerSGD_hook)": (
        torch.float16,
        _powersgd_wrapped(default_hooks.fp16_compress_wrapper),
        25,
    ),
    "bf16_compress_wrapper(powerSGD_hook)": (
        torch.bfloat16,
        _powersgd_wrapped(lambda hook: _renamed(default_hooks.bf16_compress_wrapper(hook))),
        25,
    ),
}


def _wrapped(DDP, rank: int, make_hook, bucket_cap_mb: float) -> dict:  # noqa: N803
    """The first backward's gradients (from rank 0's weights), and the parameters after STEPS
    SGD steps."""
    ddp_model = DDP(mlp(), bucket_cap_mb=bucket_cap_mb)
    ddp_model.register_comm_hook(*make_hook())
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=0.1, momentum=0.9)
    first = None
    for step in range(STEPS):
        x, y = batch(rank, step)
        F.cross_entropy(ddp_model(x), y).backward()
        if first is None:
            first = torch.cat([p.grad.reshape(-1) for p in ddp_model.parameters()])
        optimizer.step()
        optimizer.zero_grad()
    return {"first_grads": first, "params": params(ddp_model)}


def _case_wrappers(info) -> dict:
    out = {}
    for name, (_, make_hook, cap) in WRAPPERS.items():
        ours = _wrapped(ddptrain.DDP, info.rank, make_hook, cap)
        theirs = _wrapped(TorchDDP, info.rank, make_hook, cap)
        out[name] = {"ours": ours, "theirs": theirs}
    return out


@pytest.mark.parametrize("name", WRAPPERS)
def test_torch_hook_wrappers_reduce_as_on_torch_ddp(world, name):
    """torch's fp16/bf16_compress_wrapper hooks give torch's DDP's grads and parameters bitwise."""
    # set_buffer rebinds the bucket as torch's does: the wrapped hook reduces the narrow copy
    # and its result comes back into the bucket.
    results = worlds.outcome(world(WORLD_SIZE), "wrappers")
    for rank, r in enumerate(results):
        ours, theirs = r[name]["ours"], r[name]["theirs"]
        assert torch.equal(ours["first_grads"], theirs["first_grads"]), rank
        assert torch.equal(ours["params"], theirs["params"]), rank
        assert torch.equal(ours["params"], results[0][name]["ours"]["params"]), rank


# ------------------------------------------------------------------------------ refusals
def _raised(call) -> str:
    try:
        call()
    except (ValueError, RuntimeError, TypeError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def _case_refusals(info) -> dict:
    model = nn.Linear(4, 4)
    registered = ddptrain.DDP(copy.deepcopy(model))
    registered.register_comm_hook(None, default_hooks.allreduce_hook)
    late = ddptrain.DDP(copy.deepcopy(model))
    late(torch.randn(2, 4)).sum().backward()
    out = {}
    for label, call in {
        "device_ids on CPU": lambda w: w(copy.deepcopy(model), device_ids=[0]),
        "two device_ids": lambda w: w(copy.deepcopy(model), device_ids=[0, 1]),
    }.items():
        out[label] = (_raised(lambda c=call: c(ddptrain.DDP)), _raised(lambda c=call: c(TorchDDP)))
    out["hook twice"] = _raised(
        lambda: registered.register_comm_hook(None, default_hooks.allreduce_hook)
    )
    out["hook after backward"] = _raised(
        lambda: late.register_comm_hook(None, default_hooks.allreduce_hook)
    )
    out["mixed_precision"] = _raised(lambda: ddptrain.DDP(model, mixed_precision=object()))
    return out


def test_torch_arguments_err_as_torch_does(world):
    """GPU ids on CPU raise torch's error; a second or late hook or mixed_precision, a clear one."""
    for r in worlds.outcome(world(WORLD_SIZE), "refusals"):
        for label in ("device_ids on CPU", "two device_ids"):
            ours, theirs = r[label]
            assert ours == theirs and ours != "no error", (label, ours, theirs)
        assert "can only be called once" in r["hook twice"]
        assert "before the first synchronized backward" in r["hook after backward"]
        assert "mixed_precision is not supported" in r["mixed_precision"]


CASES = {
    "programs": _case_programs,
    "wrappers": _case_wrappers,
    "refusals": _case_refusals,
}
world = worlds.fixture(CASES, {WORLD_SIZE: list(CASES)}, timeout_s=300)
