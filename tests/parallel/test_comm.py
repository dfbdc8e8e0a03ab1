"""Hand-written ring all-reduce and compression hooks, against dist.all_reduce and exact sums."""

from __future__ import annotations

import contextlib
import copy
import os
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import ddptrain
import toy_models
from ddptrain.parallel.comm import CastHook, RingHook, allreduce_hook, make_hook, ring_all_reduce
from ddptrain.parallel.ddp import DistributedDataParallel
from ddptrain.parallel.shm import _COUNTER_STRIDE, SHM_DIR, SharedMemoryHook, _SharedBarrier

# Sizes around the chunking edge cases: empty, fewer elements than ranks, not divisible.
NUMELS = [0, 1, 2, 3, 5, 7, 64, 1001, 65_539]
# Stated tolerance vs dist.all_reduce for float32 at world size >= 3, where the ring adds in a
# different order than gloo: torch.testing's float32 defaults (a few ulp of the sum).
RTOL, ATOL = 1.3e-6, 1e-5
# Unit roundoff of the wire dtype: each cast and each reduction step rounds once.
UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def _run_ring_vs_backend() -> dict:
    info = ddptrain.init_distributed()
    out: dict = {"float": [], "integer": [], "float64": []}
    for numel in NUMELS:
        g = torch.Generator().manual_seed(numel * 31 + info.rank)
        x = torch.randn(numel, generator=g)
        expected = x.clone()
        dist.all_reduce(expected)
        got = ring_all_reduce(x.clone())
        out["float"].append((numel, got, expected))
        ints = torch.randint(-1000, 1000, (numel,), generator=g).float()
        out["integer"].append((numel, ring_all_reduce(ints.clone()), _all_reduce(ints)))
        wide = torch.randn(numel, generator=g, dtype=torch.float64)
        out["float64"].append((numel, ring_all_reduce(wide.clone()), _all_reduce(wide)))
    shaped = torch.arange(24.0).reshape(2, 3, 4) + info.rank
    out["shaped"] = (ring_all_reduce(shaped.clone()), _all_reduce(shaped))
    try:
        ring_all_reduce(torch.zeros(4, 4).t())
        out["non_contiguous_error"] = None
    except ValueError as e:
        out["non_contiguous_error"] = str(e)
    return out


def _all_reduce(t: torch.Tensor) -> torch.Tensor:
    t = t.clone()
    dist.all_reduce(t)
    return t


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_ring_all_reduce_equals_backend_all_reduce(world_size):
    """Ring SUM equals dist.all_reduce: bitwise at ws 2 and on integers, else float32 rtol."""
    results = ddptrain.spawn(_run_ring_vs_backend, world_size, timeout_s=120)
    for rank, r in enumerate(results):
        for numel, got, expected in r["float"]:
            assert got.shape == expected.shape == (numel,)
            if world_size == 2:
                assert torch.equal(got, expected), (rank, numel)
            else:
                torch.testing.assert_close(got, expected, rtol=RTOL, atol=ATOL)
        for numel, got, expected in r["integer"]:
            assert torch.equal(got, expected), (rank, numel)
        for _, got, expected in r["float64"]:
            torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
        assert torch.equal(*r["shaped"])
        assert "contiguous" in r["non_contiguous_error"]
        # Every rank ends with the same values.
        for (_, got, _), (_, ref, _) in zip(r["float"], results[0]["float"], strict=True):
            assert torch.equal(got, ref)


def _run_ring_on_subgroup() -> list[float] | None:
    info = ddptrain.init_distributed()
    group = dist.new_group(ranks=[1, 2])
    result = None
    if info.rank != 0:
        result = ring_all_reduce(torch.full((5,), float(info.rank)), group).tolist()
    dist.barrier()  # nobody tears the job down while the others still talk
    return result


def test_ring_all_reduce_on_a_subgroup_uses_global_ranks():
    """On a subgroup of ranks 1 and 2 of 3, the ring sums over the members only."""
    results = ddptrain.spawn(_run_ring_on_subgroup, 3, timeout_s=60)
    assert results == [None, [3.0] * 5, [3.0] * 5]


def _run_cast_hooks() -> dict:
    info = ddptrain.init_distributed()
    ws = info.world_size
    out = {}
    for dtype in (torch.bfloat16, torch.float16):
        g = torch.Generator().manual_seed(info.rank)
        values = torch.randn(10_000, generator=g) * torch.logspace(-3, 2, 10_000) / ws
        flags = torch.tensor([0.0, 1.0, 0.0, 1.0]) if info.rank == 0 else torch.zeros(4)
        flags[2] = float(info.rank == ws - 1)
        bucket = torch.cat([values, flags])
        hook = CastHook(dtype)
        hook(bucket, None).wait()
        exact = _all_reduce(values.double())
        magnitude = _all_reduce(values.double().abs())
        out[dtype] = {
            "error": (bucket[:-4].double() - exact).abs(),
            "bound": magnitude * UNIT_ROUNDOFF[dtype] * (ws + 1),
            "flags": bucket[-4:].tolist(),
        }
        # Reusing the hook on the same bucket reuses its cast buffer and stays correct.
        again = torch.full((5,), 0.5)
        hook(again, None).wait()
        out[dtype]["again"] = again.tolist()
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_cast_hooks_within_wire_precision_and_keep_used_flags(world_size):
    """bf16/fp16 sums are within (ws+1) unit roundoffs of the exact sum; 0/1 flags survive."""
    for rank, r in enumerate(ddptrain.spawn(_run_cast_hooks, world_size, timeout_s=60)):
        for dtype, d in r.items():
            assert bool((d["error"] <= d["bound"]).all()), (dtype, rank)
            expected_flags = [0.0, 1.0, 1.0, 1.0]
            assert [f != 0 for f in d["flags"]] == [f != 0 for f in expected_flags], dtype
            assert d["again"] == [0.5 * world_size] * 5


def _train(comm_hook_name: str, steps: int) -> dict:
    info = ddptrain.init_distributed()
    torch.manual_seed(3)
    base = toy_models.make("lenet_nodrop")
    if comm_hook_name == "shm-bf16":
        hook = CastHook(torch.bfloat16, SharedMemoryHook(min_bytes=0))
    else:
        hook = make_hook(comm_hook_name)
    model = DistributedDataParallel(copy.deepcopy(base), comm_hook=hook)
    exact = DistributedDataParallel(copy.deepcopy(base))
    losses = {"hook": [], "exact": []}
    for name, m in (("hook", model), ("exact", exact)):
        opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
        for step in range(steps):
            x, y = toy_models.batch("lenet", step % 4, info.rank, size=16)
            opt.zero_grad()
            loss = F.nll_loss(m(x), y)
            loss.backward()
            opt.step()
            losses[name].append(loss.item())
    params = torch.cat([p.detach().reshape(-1) for p in model.module.parameters()])
    reference = torch.cat([p.detach().reshape(-1) for p in exact.module.parameters()])
    return {"losses": losses, "params": params, "reference": reference}


@pytest.mark.parametrize("hook_name", ["ring", "ring-bf16"])
@pytest.mark.parametrize("world_size", [2, 3])
def test_ring_hook_in_the_wrapper_matches_default(world_size, hook_name):
    """The ring hook in DDP trains like the default hook: bitwise at ws 2 (fp32), else close."""
    results = ddptrain.spawn(_train, world_size, hook_name, 8, timeout_s=120)
    for r in results:
        if hook_name == "ring" and world_size == 2:
            assert torch.equal(r["params"], r["reference"])
        elif hook_name == "ring":
            torch.testing.assert_close(r["params"], r["reference"], rtol=0, atol=1e-5)
        else:
            torch.testing.assert_close(r["params"], r["reference"], rtol=0, atol=5e-3)
        assert torch.equal(r["params"], results[0]["params"])


@pytest.mark.parametrize("hook_name", ["bf16", "fp16", "allreduce-bf16", "shm-bf16"])
def test_compressed_training_tracks_exact_training(hook_name):
    """30 steps of LeNet with bf16/fp16 buckets (shm or gloo): loss falls, tracks fp32 run."""
    results = ddptrain.spawn(_train, 2, hook_name, 30, timeout_s=120)
    for r in results:
        hook, exact = r["losses"]["hook"], r["losses"]["exact"]
        assert sum(hook[-4:]) < 0.9 * sum(hook[:4])
        # Momentum amplifies rounding differences step by step, so compare the loss curves
        # (mean of the last 4 steps within 3%), not the weights.
        assert abs(sum(hook[-4:]) - sum(exact[-4:])) < 0.03 * sum(exact[-4:]), (hook, exact)
        assert torch.equal(r["params"], results[0]["params"])


def test_make_hook_names_and_errors():
    """'allreduce' is the backend's all_reduce; an unknown name lists the valid ones."""
    assert make_hook("allreduce") is allreduce_hook
    assert isinstance(make_hook("allreduce-bf16"), CastHook)
    with pytest.raises(ValueError, match="ring-bf16"):
        make_hook("int8")


def _run_ring_hook_error() -> None:
    ddptrain.init_distributed()
    hook = RingHook()
    hook(torch.zeros(4, 4).t(), None).wait()


def test_ring_hook_reraises_worker_errors():
    """An error inside the ring's worker thread surfaces at wait(), on the calling thread."""
    with pytest.raises(ddptrain.WorkerError, match="contiguous"):
        ddptrain.spawn(_run_ring_hook_error, 2, timeout_s=60)


def _run_shm_vs_backend() -> dict:
    info = ddptrain.init_distributed()
    hook = SharedMemoryHook(min_bytes=0)  # share even the tiny test buckets
    out: dict = {"float": [], "repeat": [], "prefix": hook._prefix}
    for numel in NUMELS:
        g = torch.Generator().manual_seed(numel * 7 + info.rank)
        x = torch.randn(numel, generator=g)
        bucket = hook.allocate(numel, torch.float32, torch.device("cpu"))
        bucket.copy_(x)
        hook(bucket, None).wait()
        out["float"].append((numel, bucket.clone(), _all_reduce(x)))
        # A second reduction on the same shared bucket: rows are overwritten, never mixed.
        bucket.fill_(info.rank + 1.0)
        hook(bucket, None).wait()
        out["repeat"].append(bucket.clone())
    plain = torch.full((3,), float(info.rank))
    hook(plain, None).wait()  # not allocated by the hook: backend all_reduce
    out["plain"] = plain.tolist()
    default = SharedMemoryHook(min_bytes=64 * 1024)
    small = default.allocate(1000, torch.float32, torch.device("cpu"))
    large = default.allocate(64 * 1024 // 4, torch.float32, torch.device("cpu"))
    small.fill_(1.0)
    large.fill_(1.0)
    default(small, None).wait()
    default(large, None).wait()
    out["default_shared"] = [len(default._shared), small.sum().item(), large[:3].tolist()]
    out["available"] = SharedMemoryHook.available()
    hook.close()
    return out


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_shared_memory_all_reduce_equals_backend(world_size):
    """Shared-memory SUM equals dist.all_reduce (bitwise at ws 2), repeats, leaves no files."""
    results = ddptrain.spawn(_run_shm_vs_backend, world_size, timeout_s=120)
    total = sum(r + 1.0 for r in range(world_size))
    for rank, r in enumerate(results):
        assert r["available"]
        for numel, got, expected in r["float"]:
            assert got.shape == (numel,)
            if world_size == 2:
                assert torch.equal(got, expected), (rank, numel)
            else:
                torch.testing.assert_close(got, expected, rtol=RTOL, atol=ATOL)
        for got in r["repeat"]:
            assert torch.equal(got, torch.full_like(got, total))
        assert r["plain"] == [sum(range(world_size))] * 3
        # Under min_bytes a bucket stays private (backend all_reduce); both sum right.
        assert r["default_shared"] == [1, 1000.0 * world_size, [float(world_size)] * 3]
    leftovers = [f for f in os.listdir(SHM_DIR) if f.startswith(os.path.basename(r["prefix"]))]
    assert leftovers == []


def _run_default_hooks() -> tuple[str, str]:
    ddptrain.init_distributed()
    default = DistributedDataParallel(torch.nn.Linear(2, 2))
    forced = DistributedDataParallel(torch.nn.Linear(2, 2), comm_hook=allreduce_hook)
    return type(default.comm_hook).__name__, getattr(forced.comm_hook, "__name__", "")


def test_default_hook_is_shared_memory_on_one_host_and_allreduce_alone():
    """Ranks on one CPU host get shared-memory buckets by default; one process gets all_reduce."""
    assert (
        ddptrain.spawn(_run_default_hooks, 2, timeout_s=60)
        == [("SharedMemoryHook", "allreduce_hook")] * 2
    )
    assert ddptrain.spawn(_run_default_hooks, 1, timeout_s=60) == [("function", "allreduce_hook")]


def _run_many_buckets(hook_name: str) -> dict:
    info = ddptrain.init_distributed()
    torch.manual_seed(11)
    base = toy_models.make("lenet_nodrop")
    caps = {"bucket_cap_mb": 0.002, "first_bucket_cap_mb": 0.001}
    # min_bytes=0: these test buckets are tiny, and the shared-memory path is what is tested.
    hook = SharedMemoryHook(min_bytes=0) if hook_name == "shm" else make_hook(hook_name)
    models = {
        "hook": DistributedDataParallel(copy.deepcopy(base), comm_hook=hook, **caps),
        "torch": TorchDDP(copy.deepcopy(base)),
    }
    for model in models.values():
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        for step in range(5):
            opt.zero_grad()
            for micro in range(2):
                x, y = toy_models.batch("lenet", 2 * step + micro, info.rank)
                ctx = model.no_sync() if micro == 0 else contextlib.nullcontext()
                with ctx:
                    F.nll_loss(model(x), y).backward()
            opt.step()
    flat = {
        k: torch.cat([p.detach().reshape(-1) for p in m.parameters()]) for k, m in models.items()
    }
    return {
        "equal": torch.equal(flat["hook"], flat["torch"]),
        "n_buckets": len(models["hook"].bucket_sizes_bytes),
    }


@pytest.mark.parametrize("hook_name", ["shm", "allreduce", "ring"])
def test_hooks_with_many_buckets_and_no_sync_equal_official_ddp(hook_name):
    """Many small buckets, no_sync accumulation: shm, backend and ring hooks equal torch DDP."""
    for r in ddptrain.spawn(_run_many_buckets, 2, hook_name, timeout_s=120):
        assert r["n_buckets"] > 3
        assert r["equal"]


def _run_narrowed_gradients(hook_name: str) -> bool:
    info = ddptrain.init_distributed()
    torch.manual_seed(0)
    base = torch.nn.Linear(300, 300)  # 90k weights: more than one cast piece
    model = DistributedDataParallel(copy.deepcopy(base), comm_hook=make_hook(hook_name))
    inputs = [torch.randn(4, 300, generator=torch.Generator().manual_seed(r)) for r in range(2)]
    model(inputs[info.rank]).pow(2).sum().backward()
    dtype = torch.bfloat16 if "bf16" in hook_name else torch.float16
    expected = None
    for x in inputs:
        local = copy.deepcopy(base)
        local(x).pow(2).sum().backward()
        part = (local.weight.grad * 0.5).to(dtype)
        expected = part if expected is None else expected + part
    return torch.equal(model.module.weight.grad, expected.float())


@pytest.mark.parametrize("hook_name", ["allreduce-bf16", "allreduce-fp16"])
def test_narrow_buckets_hold_each_ranks_scaled_gradient_rounded_once(hook_name):
    """bf16/fp16 buckets: grad = sum over ranks of round(g / world_size), widened, exactly."""
    assert ddptrain.spawn(_run_narrowed_gradients, 2, hook_name, timeout_s=60) == [True, True]


def test_shared_barrier_names_a_peer_that_died_and_times_out_on_a_silent_one():
    """A waiting rank raises within a second naming a dead peer; a live silent one times out."""
    peer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5)"])
    counters = torch.zeros(2 * _COUNTER_STRIDE, dtype=torch.int64)
    counters[1], counters[_COUNTER_STRIDE + 1] = os.getpid(), peer.pid
    barrier = _SharedBarrier(counters, rank=0, world_size=2, timeout_s=60)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=f"rank 1 \\(pid {peer.pid}\\) exited"):
        barrier.wait()
    assert time.monotonic() - start < 10
    peer.wait()
    counters[_COUNTER_STRIDE + 1] = os.getpid()  # a peer that lives but never arrives
    silent = _SharedBarrier(counters, rank=0, world_size=2, timeout_s=0.3)
    with pytest.raises(RuntimeError, match="did not reach"):
        silent.wait()
