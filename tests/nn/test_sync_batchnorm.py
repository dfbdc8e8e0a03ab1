"""SyncBatchNorm against nn.BatchNorm run by one process on the concatenated global batch.

One spawned world per world size runs every case and returns its tensors; the oracle (plain
nn.BatchNorm on the concatenated batch) runs here in the test process.
"""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ddptrain
from ddptrain.nn import sync_batchnorm as sbn_module
from ddptrain.train.config import TrainerConfig
from support import worlds
from support.toy_models import ToyTrainer

# Per-rank batch sizes: uneven, with a rank holding 1 sample (ws 2) and one holding 0 (ws 3).
SIZES = {1: [6], 2: [1, 6], 3: [0, 1, 7]}
STEPS = 2
# name: (BatchNorm class, constructor kwargs, per-sample shape after N, memory format, dtype)
CASES = {
    "1d (N,C)": (nn.BatchNorm1d, {}, (5,), None, torch.float32),
    "1d (N,C,L)": (nn.BatchNorm1d, {}, (5, 7), None, torch.float32),
    "2d": (nn.BatchNorm2d, {}, (3, 6, 5), None, torch.float32),
    "2d channels_last": (nn.BatchNorm2d, {}, (3, 6, 5), torch.channels_last, torch.float32),
    "3d": (nn.BatchNorm3d, {}, (3, 3, 4, 5), None, torch.float32),
    "3d channels_last": (nn.BatchNorm3d, {}, (3, 3, 4, 5), torch.channels_last_3d, torch.float32),
    "momentum None": (nn.BatchNorm2d, {"momentum": None}, (3, 6, 5), None, torch.float32),
    "no affine, no stats": (
        nn.BatchNorm2d,
        {"affine": False, "track_running_stats": False},
        (3, 6, 5),
        None,
        torch.float32,
    ),
    "float64": (nn.BatchNorm2d, {}, (3, 6, 5), None, torch.float64),
}
# The oracle runs in float64 on the same values, so the differences are our own rounding:
# float32 elementwise results and statistics to a few float32 ulps of values of size ~10.
F32_TOL = {"rtol": 1e-5, "atol": 1e-5}
F64_TOL = {"rtol": 1e-12, "atol": 1e-12}  # same reasoning, float64 rounding
# Weight/bias gradients are sums of up to ~500 O(1) terms that largely cancel: rounding is
# bounded relative to the sum of |terms| (~500 x 6e-8 x a few), not to the small result
# (measured up to 2.5e-5 against the float64 oracle).
F32_SUM_TOL = {"rtol": 1e-5, "atol": 1e-4}
F64_SUM_TOL = {"rtol": 1e-12, "atol": 1e-11}
DDP_STEPS = 10
DDP_SIZES = {1: [8], 2: [3, 5], 3: [0, 3, 5]}
# float64 model: 10 SGD steps through tanh keep summation-order differences near 1e-15.
DDP_TOL = {"rtol": 1e-10, "atol": 1e-10}


def _inputs(case: str, world_size: int, step: int, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch (input, output gradient) of one step; rank r owns rows by SIZES."""
    _, _, shape, _, case_dtype = CASES[case]
    g = torch.Generator().manual_seed(1000 * step + len(case))
    n = sum(SIZES[world_size])
    # Offset 20: a mean far from zero is where sum-of-squares variance loses digits.
    x = torch.randn(n, *shape, generator=g, dtype=case_dtype) * 2 + 20
    dy = torch.randn(n, *shape, generator=g, dtype=case_dtype)
    return x.to(dtype), dy.to(dtype)


def _rows(world_size: int, rank: int) -> slice:
    start = sum(SIZES[world_size][:rank])
    return slice(start, start + SIZES[world_size][rank])


def _make_bn(case: str) -> nn.Module:
    cls, kwargs, shape, _, dtype = CASES[case]
    torch.manual_seed(7)
    bn = cls(shape[0], **kwargs).to(dtype)
    if bn.affine:
        with torch.no_grad():
            bn.weight.uniform_(0.5, 2.0)
            bn.bias.uniform_(-1.0, 1.0)
    return bn


def _run_steps(module: nn.Module, case: str, world_size: int, rows: slice, dtype=None) -> dict:
    fmt, dtype = CASES[case][3], dtype or CASES[case][4]
    out: dict = {"y": [], "dx": [], "dw": [], "db": [], "format_kept": True}
    for step in range(STEPS):
        x, dy = _inputs(case, world_size, step, dtype)
        x, dy = x[rows], dy[rows]
        if fmt is not None:
            x, dy = x.contiguous(memory_format=fmt), dy.contiguous(memory_format=fmt)
        x.requires_grad_(True)
        y = module(x)
        (y * dy).sum().backward()
        if fmt is not None and len(x):
            out["format_kept"] &= y.is_contiguous(memory_format=fmt)
            out["format_kept"] &= x.grad.is_contiguous(memory_format=fmt)
        out["y"].append(y.detach())
        out["dx"].append(x.grad)
        if getattr(module, "weight", None) is not None:
            out["dw"].append(module.weight.grad.clone())
            out["db"].append(module.bias.grad.clone())
            module.weight.grad = module.bias.grad = None
    out["buffers"] = {k: v.clone() for k, v in module.named_buffers()}
    module.eval()
    x, _ = _inputs(case, world_size, STEPS, dtype)
    # Without running statistics eval normalizes each rank's batch by itself: nothing global.
    out["eval_y"] = module(x[rows]).detach() if module.track_running_stats else x[rows]
    return out


def _collectives(run) -> tuple[Any, dict[str, int]]:
    """run()'s result and the gather and reduce collectives it ran, as the profiler saw them."""
    with torch.profiler.profile() as prof:
        result = run()
    names = [e.name for e in prof.events()]
    return result, {
        "gather": names.count("gloo:all_gather"),
        "reduce": names.count("gloo:all_reduce"),
    }


def _error_of(fn) -> str:
    try:
        fn()
    except ValueError as e:
        return str(e)
    return "no error"


def _ddp_model() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(
        nn.Conv2d(2, 4, 3),
        nn.BatchNorm2d(4),
        nn.Tanh(),
        nn.Flatten(),
        nn.Linear(4 * 4 * 4, 6),
        nn.BatchNorm1d(6),
        nn.Tanh(),
        nn.Linear(6, 3),
    ).double()


def _ddp_batch(step: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    n = sum(DDP_SIZES[world_size])
    return torch.randn(n, 2, 6, 6, generator=g, dtype=torch.float64), torch.randint(
        0, 3, (n,), generator=g
    )


def _train(model: nn.Module, world_size: int, rank: int | None) -> nn.Module:
    """10 SGD steps; rank None trains on the global batch, else on that rank's rows."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sizes = DDP_SIZES[world_size]
    for step in range(DDP_STEPS):
        x, y = _ddp_batch(step, world_size)
        if rank is not None:
            start = sum(sizes[:rank])
            x, y = x[start : start + sizes[rank]], y[start : start + sizes[rank]]
        opt.zero_grad()
        # Sum over the rank's samples / global count, times world_size: the wrapper's mean
        # over ranks is then the global batch's mean loss, whatever the per-rank sizes.
        scale = (world_size if rank is not None else 1) / sum(sizes)
        (F.cross_entropy(model(x), y, reduction="sum") * scale).backward()
        opt.step()
    return model


def _shadow_case(world_size: int, rank: int) -> dict:
    """Rank 0 has run out of data and only answers the collectives (as join() will)."""
    module = ddptrain.convert_sync_batchnorm(_make_bn("2d"))
    if rank == 0:
        module.shadow_forward()
        module.shadow_backward()
        return {"buffers": dict(module.named_buffers())}
    x, dy = _inputs("2d", world_size, 0, torch.float32)
    x = x[_rows(world_size, rank)].requires_grad_(True)
    y = module(x)
    (y * dy[_rows(world_size, rank)]).sum().backward()
    return {"y": y.detach(), "dx": x.grad, "buffers": dict(module.named_buffers())}


def _run_world() -> dict:
    info = ddptrain.init_distributed(timeout_s=worlds.COLLECTIVE_TIMEOUT_S)
    rank, world_size = info.rank, info.world_size
    results: dict = {}
    for case in CASES:
        module = ddptrain.convert_sync_batchnorm(_make_bn(case))
        results[case], calls = _collectives(
            lambda module=module, case=case: _run_steps(
                module, case, world_size, _rows(world_size, rank)
            )
        )
        results[case]["calls"] = calls
    c = 3
    results["errors"] = {
        "modules differ": _error_of(
            lambda: ddptrain.SyncBatchNorm(c + rank)(torch.randn(2, c + rank, 4))
        ),
        "inputs differ": _error_of(
            lambda: ddptrain.SyncBatchNorm(c)(torch.randn(2, c + (rank > 0), 4))
        ),
        "one value": _error_of(lambda: ddptrain.SyncBatchNorm(c)(torch.randn(int(rank == 0), c))),
    }
    results["shadow"] = _shadow_case(world_size, rank) if world_size > 1 else None
    model = ddptrain.DDP(ddptrain.convert_sync_batchnorm(_ddp_model()))
    results["ddp"] = _train(model, world_size, rank).module.state_dict()
    return results


@pytest.fixture(scope="module", params=[1, 2, 3], ids=lambda ws: f"ws{ws}")
def world(request) -> tuple[int, list[dict]]:
    return request.param, ddptrain.spawn(_run_world, request.param, timeout_s=300)


def _oracle(case: str, world_size: int) -> dict:
    return _run_steps(_make_bn(case).double(), case, world_size, slice(None), torch.float64)


def _check(ours: torch.Tensor, ref: torch.Tensor, case: str, is_sum: bool = False) -> float:
    if CASES[case][4] == torch.float64:
        tol = F64_SUM_TOL if is_sum else F64_TOL
    else:
        tol = F32_SUM_TOL if is_sum else F32_TOL
    torch.testing.assert_close(ours.double(), ref, **tol)
    return (ours.double() - ref.double()).abs().max().item() if ref.numel() else 0.0


@pytest.mark.parametrize("case", list(CASES))
def test_matches_batchnorm_on_the_global_batch(world, case):
    """Outputs, input/weight/bias gradients, running stats and eval output equal BatchNorm's."""
    world_size, results = world
    ref = _oracle(case, world_size)
    per_rank = [r[case] for r in results]
    diffs = {}
    for key in ("y", "dx", "eval_y"):
        for step in range(STEPS if key != "eval_y" else 1):
            ours = torch.cat([r[key][step] if key != "eval_y" else r[key] for r in per_rank])
            want = ref[key][step] if key != "eval_y" else ref[key]
            diffs[key] = max(diffs.get(key, 0.0), _check(ours, want, case))
    for key in ("dw", "db"):  # each rank holds its own sum; the wrapper adds them up
        for step in range(len(ref[key])):
            ours = torch.stack([r[key][step] for r in per_rank]).sum(0)
            diffs[key] = max(diffs.get(key, 0.0), _check(ours, ref[key][step], case, True))
    for r in per_rank:
        assert r["buffers"].keys() == ref["buffers"].keys()
        for name, buf in r["buffers"].items():
            if name == "num_batches_tracked":
                assert buf.item() == ref["buffers"][name].item() == STEPS
            else:
                diffs[name] = _check(buf, ref["buffers"][name], case)
        assert r["format_kept"]
        # One each way per step, one more gather for the first call's channel check; eval: none.
        assert r["calls"] == {"gather": STEPS + 1, "reduce": STEPS}, r["calls"]
    print(f"ws={world_size} {case}: " + " ".join(f"{k}={v:.1e}" for k, v in diffs.items()))


def test_errors_are_clear_and_raised_on_every_rank(world):
    """Different channel counts, or one value per channel globally, raise on every rank."""
    world_size, results = world
    errors = [r["errors"] for r in results]
    for e in errors:
        assert "Expected more than 1 value per channel" in e["one value"]
        if world_size > 1:
            assert "different channel counts" in e["modules differ"]
            assert "[3, 4" in e["modules differ"]
            assert "different channel counts" in e["inputs differ"]
        else:
            assert e["modules differ"] == e["inputs differ"] == "no error"


def test_a_rank_without_data_can_answer_with_shadow_calls(world):
    """shadow_forward/backward on rank 0 leave the others' results those of their own batch."""
    world_size, results = world
    if world_size == 1:
        pytest.skip("needs a second rank holding data")
    bn = _make_bn("2d").double()
    x, dy = _inputs("2d", world_size, 0, torch.float64)
    rest = slice(SIZES[world_size][0], None)
    x = x[rest].requires_grad_(True)
    y = bn(x)
    (y * dy[rest]).sum().backward()
    shadow = [r["shadow"] for r in results]
    _check(torch.cat([s["y"] for s in shadow[1:]]), y.detach(), "2d")
    _check(torch.cat([s["dx"] for s in shadow[1:]]), x.grad, "2d")
    for s in shadow:  # rank 0's running statistics follow the others' batch too
        _check(s["buffers"]["running_mean"], bn.running_mean, "2d")
        _check(s["buffers"]["running_var"], bn.running_var, "2d")
        assert s["buffers"]["num_batches_tracked"].item() == 1


def test_ddp_training_equals_one_process_on_the_global_batch(world):
    """10 DDP steps with SyncBatchNorm (uneven ranks, one empty) equal BatchNorm on one process."""
    world_size, results = world
    ref = _train(_ddp_model(), world_size, None).state_dict()
    worst = 0.0
    for r in results:
        for name, value in ref.items():
            torch.testing.assert_close(r["ddp"][name], value, **DDP_TOL)
            worst = max(worst, (r["ddp"][name].double() - value.double()).abs().max().item())
    print(f"ws={world_size} ddp 10 steps: max|diff|={worst:.1e}")


def test_convert_keeps_every_setting_and_tensor():
    """convert_sync_batchnorm keeps weights, buffers, flags, momentum None, requires_grad."""
    model = nn.Sequential(
        nn.Conv2d(1, 3, 3),
        nn.BatchNorm2d(3, eps=1e-3, momentum=None),
        nn.Sequential(nn.Flatten(), nn.BatchNorm1d(4, affine=False)),
        nn.BatchNorm3d(2, track_running_stats=False).double(),
    )
    model[1].weight.requires_grad_(False)
    model[1].running_mean.fill_(0.5)
    model[1].num_batches_tracked.fill_(7)
    model[2][1].eval()
    original = copy.deepcopy(model)
    tensors = {k: v for k, v in model.state_dict(keep_vars=True).items()}
    converted = ddptrain.convert_sync_batchnorm(model, process_group="pg")
    bns = [converted[1], converted[2][1], converted[3]]
    assert all(type(m) is ddptrain.SyncBatchNorm for m in bns)
    assert all(m.process_group == "pg" for m in bns)
    for name, value in converted.state_dict(keep_vars=True).items():
        assert value is tensors[name]  # the same tensors, not copies
        assert torch.equal(value, original.state_dict()[name])
    for new, old in zip(bns, [original[1], original[2][1], original[3]], strict=True):
        for attr in ("num_features", "eps", "momentum", "affine", "track_running_stats"):
            assert getattr(new, attr) == getattr(old, attr)
        assert new.training == old.training
    assert not converted[1].weight.requires_grad and converted[1].bias.requires_grad
    assert converted[3].running_mean is None and converted[1].momentum is None
    assert converted[3].weight.dtype == torch.float64


class _BatchNormTrainer(ToyTrainer):
    def build_model(self):
        return nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.Tanh(), nn.Linear(32, 3))


def _run_trainers(configs: list[TrainerConfig]) -> list[dict]:
    ddptrain.init_distributed()
    out = []
    for config in configs:
        trainer = _BatchNormTrainer(config)
        trainer.fit()
        module = trainer.model.module
        out.append(
            {
                "state": module.state_dict(),
                "sync": any(isinstance(m, ddptrain.SyncBatchNorm) for m in module.modules()),
            }
        )
    return out


def test_trainer_sync_batchnorm_trains_like_one_process():
    """TrainerConfig(sync_batchnorm=True) at ws=2 ends where one process does; local BN does not."""
    cfg = TrainerConfig(global_batch_size=12, epochs=2, progress_bar=False, sync_batchnorm=True)
    (one,) = ddptrain.spawn(_run_trainers, 1, [cfg], timeout_s=300)[0]
    (sync, local), _ = ddptrain.spawn(
        _run_trainers, 2, [cfg, replace(cfg, sync_batchnorm=False)], timeout_s=300
    )
    assert sync["sync"] and not local["sync"]
    worst = {"sync": 0.0, "local": 0.0}
    for name, value in one["state"].items():
        for key, run in (("sync", sync), ("local", local)):
            diff = (run["state"][name].double() - value.double()).abs().max().item()
            worst[key] = max(worst[key], diff)
    print(f"trainer ws=2 vs ws=1 after 16 steps: {worst}")
    # float32, 16 steps: the per-rank sums and the gradient mean round differently (1e-6 per
    # step); tanh keeps that from growing. Local BN normalizes each half batch on its own.
    assert worst["sync"] < 1e-4
    assert worst["local"] > 1e-2


def test_merge_is_stable_where_sum_of_squares_is_not():
    """Merging per-rank (count, mean, M2) of float32 data with mean 1e4 keeps the variance."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4000, 3, generator=g) + 1e4
    parts = [x[:1], x[1:1], x[1:2500], x[2500:]]  # uneven, one empty
    gathered = torch.stack([sbn_module._local_stats(p, 3) for p in parts])
    mean, m2 = sbn_module._merge(gathered[:, 0], gathered, 3)
    exact = x.double().var(0, unbiased=False)
    torch.testing.assert_close(mean, x.double().mean(0), rtol=1e-7, atol=0)
    # Measured 1.6e-5: the float32 per-rank var_mean; the merge itself is float64.
    torch.testing.assert_close(m2 / len(x), exact, rtol=1e-4, atol=0)
    naive = (x * x).mean(0) - x.mean(0) ** 2  # float32 E[x^2] - E[x]^2: -16, 16, 0 for ~1
    assert ((naive.double() - exact).abs() > 0.1).any()
