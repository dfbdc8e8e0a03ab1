"""Oracle tests: ddptrain.DDP against torch's DistributedDataParallel and one big-batch process."""

from __future__ import annotations

import copy
import time
from contextlib import nullcontext

import pytest
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import ddptrain
import toy_models
from ddptrain.parallel.ddp import DistributedDataParallel

STEPS = 10
WORLD_SIZES = [1, 2, 3]
CASES = ["lenet", "batchnorm", "tied", "branch", "frozen", "no_sync"]
# Stated tolerance against official DDP. At world size <= 2 the sums are the same
# floating-point operations and results are bitwise equal; at 3 the summation order inside
# gloo's ring depends on bucket layout, so last-bit differences may appear.
ORACLE_ATOL = 1e-6
MICRO_STEPS = 3


def _flat(module: torch.nn.Module) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).double() for t in module.state_dict().values()])


def _flat_params(module: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).double() for p in module.parameters()])


def _sgd(model: torch.nn.Module) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=1e-3)


def _train_pair(case: str, rank: int) -> dict:
    name = "lenet" if case == "no_sync" else case
    torch.manual_seed(1234 + rank)  # each rank starts from different weights
    base = toy_models.make(name)
    base_flat = _flat(base)
    ours = DistributedDataParallel(copy.deepcopy(base))
    theirs = TorchDDP(copy.deepcopy(base), find_unused_parameters=name == "branch")
    initial = _flat(ours.module)
    micro = MICRO_STEPS if case == "no_sync" else 1
    for model in (ours, theirs):
        opt = _sgd(model)
        for step in range(STEPS):
            opt.zero_grad()
            for m in range(micro):
                x, y = toy_models.batch(name, step * micro + m, rank)
                torch.manual_seed(100 * step + 10 * m + rank)  # same dropout masks for both
                sync = nullcontext() if m == micro - 1 else model.no_sync()
                with sync:
                    toy_models.loss_of(name, model, x, y, rank).backward()
            opt.step()
    ours_params = dict(ours.module.named_parameters())
    theirs_params = dict(theirs.module.named_parameters())
    diffs = [
        (ours_params[n].detach() - theirs_params[n].detach()).abs().max().item()
        for n in ours_params
    ]
    return {
        "max_diff": max(diffs),
        "bitwise": all(torch.equal(ours_params[n], theirs_params[n]) for n in ours_params),
        "buffer_diff": max(
            [
                (a.double() - b.double()).abs().max().item()
                for a, b in zip(ours.module.buffers(), theirs.module.buffers(), strict=True)
            ],
            default=0.0,
        ),
        # Buffers are excluded: BatchNorm statistics are rank-local until the next forward.
        "final": _flat_params(ours.module),
        "initial": initial,
        "base": base_flat,
        "grad_none_ours": sorted(n for n, p in ours_params.items() if p.grad is None),
        "grad_none_theirs": sorted(n for n, p in theirs_params.items() if p.grad is None),
    }


def _run_oracle(cases: list[str]) -> dict:
    info = ddptrain.init_distributed()
    return {case: _train_pair(case, info.rank) for case in cases}


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda w: f"ws{w}")
def oracle(request) -> tuple[int, list[dict]]:
    world_size = request.param
    return world_size, ddptrain.spawn(_run_oracle, world_size, CASES, timeout_s=240)


@pytest.mark.parametrize("case", CASES)
def test_matches_official_ddp(oracle, case):
    """After 10 SGD+momentum+weight-decay steps, parameters equal official DDP's within 1e-6."""
    world_size, results = oracle
    for rank, result in enumerate(results):
        r = result[case]
        print(
            f"{case} ws={world_size} rank={rank}: max|diff|={r['max_diff']:.3g} "
            f"bitwise={r['bitwise']}"
        )
        assert r["max_diff"] <= ORACLE_ATOL, (case, world_size, rank, r["max_diff"])
        assert r["buffer_diff"] <= ORACLE_ATOL, (case, world_size, rank, r["buffer_diff"])
        if world_size <= 2:
            assert r["bitwise"] and r["buffer_diff"] == 0, (case, world_size, rank)


@pytest.mark.parametrize("case", CASES)
def test_replicas_identical_and_start_from_rank0(oracle, case):
    """Different per-rank initial weights become rank 0's; replicas stay bitwise identical."""
    world_size, results = oracle
    rank0 = results[0][case]
    assert torch.equal(rank0["initial"], rank0["base"])
    for r in results[1:]:
        assert not torch.equal(r[case]["base"], rank0["base"])
        assert torch.equal(r[case]["initial"], rank0["base"])
        assert torch.equal(r[case]["final"], rank0["final"])


def test_unused_parameters_keep_grad_none(oracle):
    """A parameter unused on every rank keeps grad=None, exactly as in official DDP."""
    world_size, results = oracle
    for r in results:
        branch = r["branch"]
        assert branch["grad_none_ours"] == branch["grad_none_theirs"]
        assert "never_used.weight" in branch["grad_none_ours"]
        # The branch runs on odd ranks only: with one rank it is unused everywhere.
        assert ("branch.weight" in branch["grad_none_ours"]) == (world_size == 1)
        assert r["frozen"]["grad_none_ours"] == ["frozen.bias", "frozen.weight"]


def _run_vs_single(world_size: int, global_batch: int) -> dict:
    info = ddptrain.init_distributed()
    torch.manual_seed(7)
    base = toy_models.make("lenet_nodrop")
    ours = DistributedDataParallel(copy.deepcopy(base))
    opt = _sgd(ours)
    per_rank = global_batch // world_size
    single = copy.deepcopy(base) if info.rank == 0 else None
    single_opt = _sgd(single) if single is not None else None
    for step in range(STEPS):
        x, y = toy_models.batch("lenet", step, rank=0, size=global_batch)
        lo, hi = info.rank * per_rank, (info.rank + 1) * per_rank
        opt.zero_grad()
        F.nll_loss(ours(x[lo:hi]), y[lo:hi]).backward()
        opt.step()
        if single is not None:
            single_opt.zero_grad()
            F.nll_loss(single(x), y).backward()
            single_opt.step()
    out = {"ours": _flat(ours.module)}
    if single is not None:
        out["single"] = _flat(single)
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_matches_one_process_on_global_batch(world_size):
    """N ranks on slices of a global batch equal one process on the whole batch (1e-5)."""
    results = ddptrain.spawn(_run_vs_single, world_size, world_size, 12, timeout_s=120)
    single = results[0]["single"]
    for r in results:
        diff = (r["ours"] - single).abs().max().item()
        print(f"ws={world_size}: max|ours - single process| = {diff:.3g}")
        torch.testing.assert_close(r["ours"], single, atol=1e-5, rtol=0)


def _run_shape_mismatch() -> None:
    info = ddptrain.init_distributed()
    width = 8 if info.rank == 0 else 9
    DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(4, width)))


def test_shape_mismatch_is_a_clear_error_within_seconds():
    """Ranks wrapping different shapes get an error naming the parameter and rank, no hang."""
    start = time.monotonic()
    with pytest.raises(ddptrain.WorkerError) as excinfo:
        ddptrain.spawn(_run_shape_mismatch, 2, timeout_s=60)
    elapsed = time.monotonic() - start
    message = str(excinfo.value)
    assert "ranks wrap different models" in message
    assert "0.weight" in message and "rank 1" in message
    assert elapsed < 30, elapsed


def _run_no_sync_semantics() -> bool:
    """Return whether no_sync left rank-local grads and the next backward averaged the sum."""
    info = ddptrain.init_distributed()
    model = DistributedDataParallel(torch.nn.Linear(3, 1, bias=False))
    with torch.no_grad():
        model.module.weight.fill_(1.0)
    x = torch.full((1, 3), float(info.rank + 1))
    with model.no_sync():
        model(x).sum().backward()
    local = model.module.weight.grad.clone()
    model(x).sum().backward()
    # grad of sum(w.x) is x: accumulated 2x locally, then averaged over ranks.
    world = info.world_size
    expected = 2 * torch.full((1, 3), sum(r + 1 for r in range(world)) / world)
    return torch.equal(local, x) and torch.equal(model.module.weight.grad, expected)


def test_no_sync_accumulates_locally_then_averages_sum():
    """Inside no_sync grads stay local; the next synced backward averages the accumulated sum."""
    assert ddptrain.spawn(_run_no_sync_semantics, 2, timeout_s=60) == [True, True]


def _run_backward_twice() -> None:
    ddptrain.init_distributed()
    model = DistributedDataParallel(torch.nn.Linear(3, 1))
    loss = model(torch.ones(2, 3)).sum()
    loss.backward(retain_graph=True)
    loss.backward()


def test_backward_twice_is_a_clear_error():
    """A second backward on one forward raises a clear error instead of double-reducing."""
    with pytest.raises(ddptrain.WorkerError, match="backward was called twice"):
        ddptrain.spawn(_run_backward_twice, 1, timeout_s=60)


def _run_param_added() -> None:
    ddptrain.init_distributed()
    module = torch.nn.Sequential(torch.nn.Linear(3, 3))
    model = DistributedDataParallel(module)
    module.append(torch.nn.Linear(3, 1))
    model(torch.ones(1, 3))


def test_parameters_added_after_wrapping_are_refused():
    """Adding a parameter after wrapping is refused at the next forward with the fix named."""
    with pytest.raises(ddptrain.WorkerError, match="parameters changed after wrapping"):
        ddptrain.spawn(_run_param_added, 1, timeout_s=60)


def test_needs_a_process_group():
    """Wrapping without a process group names the call that is missing."""
    with pytest.raises(RuntimeError, match="init_distributed"):
        DistributedDataParallel(torch.nn.Linear(2, 2))


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


def _run_rebuild(rebuild: bool) -> dict:
    info = ddptrain.init_distributed()
    torch.manual_seed(0)
    base = _UsedInReverse()
    # Tiny caps: one parameter per bucket, so bucket order is parameter order.
    caps = {"bucket_cap_mb": 1e-6, "first_bucket_cap_mb": 1e-6}
    ours = DistributedDataParallel(copy.deepcopy(base), rebuild_buckets=rebuild, **caps)
    theirs = TorchDDP(copy.deepcopy(base), find_unused_parameters=True)
    before = ours.bucket_param_names
    for model in (ours, theirs):
        opt = _sgd(model)
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


def test_buckets_rebuilt_in_rank0_ready_order_after_first_backward():
    """The first backward's gradient-ready order (rank 0's) becomes the bucket order everywhere."""
    results = ddptrain.spawn(_run_rebuild, 2, True, timeout_s=60)
    for r in results:
        assert _layers(r["before"]) == ["side", "side", "first", "first", "second", "second"]
        # second's gradients are ready first; rank 0 never uses side, so side goes last.
        assert _layers(r["after"]) == ["second", "second", "first", "first", "side", "side"]
        assert r["after"] == results[0]["after"]
        assert r["bitwise"]


def test_rebuild_can_be_turned_off():
    """rebuild_buckets=False keeps the reverse-registration bucket order."""
    results = ddptrain.spawn(_run_rebuild, 2, False, timeout_s=60)
    for r in results:
        assert r["after"] == r["before"]
        assert r["bitwise"]


def _run_view_modes(set_to_none: bool) -> dict:
    info = ddptrain.init_distributed()
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
            opt = _sgd(model)
            for step in range(5):
                x, y = toy_models.batch(name, step, info.rank)
                torch.manual_seed(step)
                opt.zero_grad(set_to_none=set_to_none)
                toy_models.loss_of(name, model, x, y, info.rank).backward()
                opt.step()
        flat = {k: _flat_params(m.module) for k, m in runs.items()}
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
def test_gradient_as_bucket_view_both_modes_bitwise_equal_official(set_to_none):
    """View and copy modes equal official DDP (gradient_as_bucket_view=True) bitwise at ws 2."""
    for r in ddptrain.spawn(_run_view_modes, 2, set_to_none, timeout_s=120):
        for name, d in r.items():
            assert d["view_equal"] and d["copy_equal"], (name, d)
            # Views: grads live in the bucket buffers; copies: one storage per parameter.
            assert d["view_storages"] == d["n_buckets"], (name, d)
            assert d["copy_storages"] > d["n_buckets"], (name, d)


def _run_structure_changes() -> dict:
    ddptrain.init_distributed()
    module = torch.nn.Sequential(torch.nn.Linear(3, 3))
    model = DistributedDataParallel(module)
    module.append(torch.nn.ReLU())  # no parameters: still fine
    model(torch.ones(1, 3))
    module[0].register_parameter("extra", torch.nn.Parameter(torch.ones(1)))
    try:
        model(torch.ones(1, 3))
    except RuntimeError as e:
        return {"error": str(e)}
    return {"error": None}


def test_parameter_added_to_an_existing_layer_is_refused_but_a_plain_layer_is_not():
    """A new parameter on a wrapped layer is caught; appending a parameter-free layer is fine."""
    [result] = ddptrain.spawn(_run_structure_changes, 1, timeout_s=60)
    assert "parameters changed after wrapping" in result["error"]
