"""The transports: the hand-written ring and bf16/fp16 casts against dist.all_reduce and exact
sums, and each of them inside the wrapper against official DDP.

One spawned world per world size runs every multi-process case of this module
(worlds.run_cases); the tests read their case's results from it.
"""

from __future__ import annotations

import contextlib
import copy
import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from ddptrain.comm import make_transport, named_hook
from ddptrain.compress.half import HalfPrecision
from ddptrain.cpu.ring import Ring, ring_all_reduce
from ddptrain.cpu.shm import SharedMemory
from ddptrain.ddp.hooks import transport_hook
from ddptrain.ddp.wrapper import DistributedDataParallel
from support import toy_models, worlds
from support.sums import ATOL, NUMELS, RTOL, backend_sum, needs_shm, reduce_with

# A spawned world runs many cases, so its first test waits for all of them: generous bounds
# (a loaded 2-core machine runs it several times slower) that a hang still reaches.
WORLD_TIMEOUT_S = 540
pytestmark = pytest.mark.timeout(WORLD_TIMEOUT_S + 60)

# 8 SGD+momentum steps of the smooth tanh MLP (no ReLU/max-pool, whose kinks turn last-bit
# differences into 1e-4 on some CPUs), ring vs gloo all_reduce at ws 3: a few ulps per step,
# carried by momentum (gain <= 10) and lr 0.05; measured 1.5e-8 on a 2-core AMD EPYC.
SMOOTH_ATOL = 1e-5
# The same with bf16 buckets vs fp32: each averaged gradient is rounded to bf16 (relative
# 2^-8), so 8 steps x lr 0.05 x momentum gain 10 x 2^-8 x |g| (<= 0.1) bound it by 1.6e-3;
# measured 9.1e-5 (ws 3) on a 2-core AMD EPYC.
BF16_SMOOTH_ATOL = 2e-3
# Unit roundoff of the wire dtype: each cast and each reduction step rounds once.
UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}

CASES_BY_WORLD = {
    2: [
        "ring_vs_backend",
        "cast_hooks",
        "smooth_hooks",
        "compressed",
        "names",
        "ring_error",
        "many_buckets_shm",
        "many_buckets_allreduce",
        "many_buckets_ring",
        "many_buckets_tcp",
        "narrowed_allreduce-bf16",
        "narrowed_allreduce-fp16",
    ],
    3: ["ring_vs_backend", "ring_on_subgroup", "cast_hooks", "smooth_hooks"],
    4: ["ring_vs_backend"],
}


def _case_ring_vs_backend(info) -> dict:
    out: dict = {"float": [], "integer": [], "float64": []}
    for numel in NUMELS:
        g = torch.Generator().manual_seed(numel * 31 + info.rank)
        x = torch.randn(numel, generator=g)
        expected = x.clone()
        dist.all_reduce(expected)
        got = ring_all_reduce(x.clone())
        out["float"].append((numel, got, expected))
        ints = torch.randint(-1000, 1000, (numel,), generator=g).float()
        out["integer"].append((numel, ring_all_reduce(ints.clone()), backend_sum(ints)))
        wide = torch.randn(numel, generator=g, dtype=torch.float64)
        out["float64"].append((numel, ring_all_reduce(wide.clone()), backend_sum(wide)))
    shaped = torch.arange(24.0).reshape(2, 3, 4) + info.rank
    out["shaped"] = (ring_all_reduce(shaped.clone()), backend_sum(shaped))
    try:
        ring_all_reduce(torch.zeros(4, 4).t())
        out["non_contiguous_error"] = None
    except ValueError as e:
        out["non_contiguous_error"] = str(e)
    return out


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_ring_all_reduce_equals_backendbackend_sum(world, world_size):
    """Ring SUM equals dist.all_reduce: bitwise at ws 2 and on integers, else float32 rtol."""
    results = worlds.outcome(world(world_size), "ring_vs_backend")
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


def _case_ring_on_subgroup(info) -> list[float] | None:
    group = dist.new_group(ranks=[1, 2])
    result = None
    if info.rank != 0:
        result = ring_all_reduce(torch.full((5,), float(info.rank)), group).tolist()
    dist.barrier()  # nobody tears the job down while the others still talk
    return result


def test_ring_all_reduce_on_a_subgroup_uses_global_ranks(world):
    """On a subgroup of ranks 1 and 2 of 3, the ring sums over the members only."""
    results = worlds.outcome(world(3), "ring_on_subgroup")
    assert results == [None, [3.0] * 5, [3.0] * 5]


def _case_cast_hooks(info) -> dict:
    ws = info.world_size
    out = {}
    for dtype in (torch.bfloat16, torch.float16):
        g = torch.Generator().manual_seed(info.rank)
        values = torch.randn(10_000, generator=g) * torch.logspace(-3, 2, 10_000) / ws
        flags = torch.tensor([0.0, 1.0, 0.0, 1.0]) if info.rank == 0 else torch.zeros(4)
        flags[2] = float(info.rank == ws - 1)
        bucket = torch.cat([values, flags])
        cast = HalfPrecision(dtype)
        reduce_with(cast, bucket)
        exact = backend_sum(values.double())
        magnitude = backend_sum(values.double().abs())
        out[dtype] = {
            "error": (bucket[:-4].double() - exact).abs(),
            "bound": magnitude * UNIT_ROUNDOFF[dtype] * (ws + 1),
            "flags": bucket[-4:].tolist(),
        }
        # Reusing the transport on the same bucket reuses its cast buffer and stays correct.
        again = torch.full((5,), 0.5)
        reduce_with(cast, again)
        out[dtype]["again"] = again.tolist()
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_cast_transports_within_wire_precision_and_keep_used_flags(world, world_size):
    """bf16/fp16 sums are within (ws+1) unit roundoffs of the exact sum; 0/1 flags survive."""
    for rank, r in enumerate(worlds.outcome(world(world_size), "cast_hooks")):
        for dtype, d in r.items():
            assert bool((d["error"] <= d["bound"]).all()), (dtype, rank)
            expected_flags = [0.0, 1.0, 1.0, 1.0]
            assert [f != 0 for f in d["flags"]] == [f != 0 for f in expected_flags], dtype
            assert d["again"] == [0.5 * world_size] * 5


def _train(model_name: str, comm_hook_name: str, steps: int) -> dict:
    """Losses and final weights of `steps` SGD steps with the named transport (None: default)."""
    torch.manual_seed(3)
    base = toy_models.make(model_name)
    if comm_hook_name == "shm-bf16":
        transport = HalfPrecision(torch.bfloat16, SharedMemory(min_bytes=0))
    else:
        transport = make_transport(comm_hook_name) if comm_hook_name else None
    model = DistributedDataParallel(
        base, comm_hook=(transport, transport_hook) if transport is not None else None
    )
    rank = dist.get_rank()
    losses = []
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(steps):
        x, y = toy_models.batch(model_name, step % 4, rank, size=16)
        opt.zero_grad()
        loss = F.nll_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {
        "losses": losses,
        "params": torch.cat([p.detach().reshape(-1) for p in base.parameters()]),
    }


SMOOTH_HOOKS = ["ring", "ring-bf16"]
COMPRESSED_HOOKS = ["bf16", "fp16", "allreduce-bf16", "shm-bf16"]
COMPRESSED_STEPS = 30


def _case_smooth_hooks(info) -> dict:
    return {h: _train("tanh", h, 8) for h in [None, *SMOOTH_HOOKS]}


def _case_compressed_hooks(info) -> dict:
    # The fp32 reference (default hook) is trained once and shared by every compressed run.
    return {h: _train("lenet_nodrop", h, COMPRESSED_STEPS) for h in [None, *COMPRESSED_HOOKS]}


@pytest.mark.parametrize("hook_name", SMOOTH_HOOKS)
@pytest.mark.parametrize("world_size", [2, 3])
def test_ring_transport_in_the_wrapper_matches_default(world, world_size, hook_name):
    """The ring trains a tanh MLP like the default transport: bitwise at ws 2 (fp32), else close."""
    results = worlds.outcome(world(world_size), "smooth_hooks")
    for r in results:
        got, reference = r[hook_name]["params"], r[None]["params"]
        diff = (got - reference).abs().max().item()
        print(f"{hook_name} ws={world_size}: max|hook - default| = {diff:.3g}")
        if hook_name == "ring" and world_size == 2:
            assert torch.equal(got, reference)
        elif hook_name == "ring":
            assert diff <= SMOOTH_ATOL
        else:
            assert diff <= BF16_SMOOTH_ATOL
        assert torch.equal(got, results[0][hook_name]["params"])


@pytest.mark.parametrize(
    "hook_name", [pytest.param(h, marks=needs_shm) if "shm" in h else h for h in COMPRESSED_HOOKS]
)
def test_compressed_training_tracks_exact_training(world, hook_name):
    """30 steps of LeNet with bf16/fp16 buckets (shm or gloo): loss falls, tracks fp32 run."""
    results = [r[hook_name] | {"exact": r[None]} for r in worlds.outcome(world(2), "compressed")]
    for r in results:
        hook, exact = r["losses"], r["exact"]["losses"]
        assert sum(hook[-4:]) < 0.9 * sum(hook[:4])
        # Momentum amplifies rounding differences step by step, so compare the loss curves
        # (mean of the last 4 steps within 3%), not the weights.
        assert abs(sum(hook[-4:]) - sum(exact[-4:])) < 0.03 * sum(exact[-4:]), (hook, exact)
        assert torch.equal(r["params"], results[0]["params"])


def _case_names(info) -> dict:
    built = {name: make_transport(name) for name in ("allreduce-bf16", "ring-fp16")}
    try:
        make_transport("int8")
    except ValueError as e:
        unknown = str(e)
    cast = {name: (type(built[name].inner).__name__, built[name].dtype) for name in built}
    return {"allreduce": type(make_transport("allreduce")).__name__, **cast, "unknown": unknown}


def test_transport_names_and_errors(world):
    """'allreduce' is all_reduce, 'x-bf16' casts around x; an unknown name lists the valid ones."""
    for r in worlds.outcome(world(2), "names"):
        assert r["allreduce"] == "AllReduce"
        assert r["allreduce-bf16"] == ("AllReduce", torch.bfloat16)
        assert r["ring-fp16"] == ("Ring", torch.float16)
        assert "ring-bf16" in r["unknown"]


def _case_ring_error(info) -> str:
    try:
        reduce_with(Ring(), torch.zeros(4, 4).t())
    except ValueError as e:
        return str(e)
    return "no error"


def test_ring_refuses_a_tensor_it_cannot_reduce_in_place(world):
    """A non-contiguous bucket is a clear error, on every rank."""
    assert all("contiguous" in m for m in worlds.outcome(world(2), "ring_error"))


def _many_buckets(info, hook_name: str) -> dict:
    torch.manual_seed(11)
    base = toy_models.make("lenet_nodrop")
    caps = {"bucket_cap_mb": 0.002, "first_bucket_cap_mb": 0.001}
    # min_bytes=0: these test buckets are tiny, and the shared-memory path is what is tested.
    transport = SharedMemory(min_bytes=0) if hook_name == "shm" else make_transport(hook_name)
    models = {
        "hook": DistributedDataParallel(
            copy.deepcopy(base), comm_hook=(transport, transport_hook), **caps
        ),
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


@pytest.mark.parametrize(
    "hook_name", [pytest.param("shm", marks=needs_shm), "allreduce", "ring", "tcp"]
)
def test_transports_with_many_buckets_and_no_sync_equal_official_ddp(world, hook_name):
    """Many small buckets, no_sync accumulation: shm, backend, ring, tcp equal torch DDP."""
    for r in worlds.outcome(world(2), f"many_buckets_{hook_name}"):
        assert r["n_buckets"] > 3
        assert r["equal"]


def _narrowed_gradients(info, hook_name: str) -> bool:
    torch.manual_seed(0)
    base = torch.nn.Linear(300, 300)  # 90k weights: more than one cast piece
    model = DistributedDataParallel(copy.deepcopy(base), comm_hook=named_hook(hook_name))
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
def test_narrow_buckets_hold_each_ranks_scaled_gradient_rounded_once(world, hook_name):
    """bf16/fp16 buckets: grad = sum over ranks of round(g / world_size), widened, exactly."""
    assert worlds.outcome(world(2), f"narrowed_{hook_name}") == [True, True]


CASES = {
    "ring_vs_backend": _case_ring_vs_backend,
    "ring_on_subgroup": _case_ring_on_subgroup,
    "cast_hooks": _case_cast_hooks,
    "smooth_hooks": _case_smooth_hooks,
    "compressed": _case_compressed_hooks,
    "names": _case_names,
    "ring_error": _case_ring_error,
    **{
        f"many_buckets_{h}": functools.partial(_many_buckets, hook_name=h)
        for h in ("shm", "allreduce", "ring", "tcp")
    },
    **{
        f"narrowed_{h}": functools.partial(_narrowed_gradients, hook_name=h)
        for h in ("allreduce-bf16", "allreduce-fp16")
    },
}


world = worlds.fixture(
    CASES, CASES_BY_WORLD, timeout_s=WORLD_TIMEOUT_S, setup=worlds.share_small_buckets
)
