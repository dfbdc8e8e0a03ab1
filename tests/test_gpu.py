"""CUDA/NCCL path (run with -m gpu on a machine with a GPU; deselected by default).

Every case runs in a spawned world, so the test process itself never initializes CUDA. With
one GPU the worlds are of one rank, which still runs every collective through NCCL.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import ddptrain
from ddptrain.ddp.wrapper import DistributedDataParallel
from ddptrain.fsdp.wrapper import FullyShardedDataParallel
from ddptrain.models import LeNet
from ddptrain.nn.sync_batchnorm import SyncBatchNorm
from ddptrain.optim.zero import ZeroRedundancyOptimizer
from ddptrain.train import checkpoint as ckpt
from ddptrain.train.build import pin_kernels
from ddptrain.train.config import TrainerConfig
from support import toy_models

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _run_nccl_oracle() -> dict:
    info = ddptrain.init_distributed()
    torch.manual_seed(0)
    base = toy_models.make("lenet_nodrop").to(info.device)
    ours = DistributedDataParallel(copy.deepcopy(base))
    theirs = TorchDDP(copy.deepcopy(base), device_ids=[info.local_rank])
    for model in (ours, theirs):
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        for step in range(10):
            x, y = toy_models.batch("lenet", step, info.rank)
            opt.zero_grad()
            F.nll_loss(model(x.to(info.device)), y.to(info.device)).backward()
            opt.step()
    diffs = [
        (a - b).abs().max().item()
        for a, b in zip(ours.module.parameters(), theirs.module.parameters(), strict=True)
    ]
    return {"backend": info.backend, "device": str(info.device), "max_diff": max(diffs)}


@pytest.mark.parametrize("world_size", [1, 2])
def test_nccl_wrapper_matches_official_ddp_on_cuda(world_size):
    """On CUDA with NCCL, 10 steps of LeNet equal official DDP (bitwise at 1-2 ranks)."""
    if torch.cuda.device_count() < world_size:
        pytest.skip(f"needs {world_size} GPUs")
    results = ddptrain.spawn(_run_nccl_oracle, world_size, timeout_s=300)
    for r in results:
        assert r["backend"] == "nccl" and r["device"].startswith("cuda")
        assert r["max_diff"] == 0.0, r


def _run_fully_sharded() -> dict:
    info = ddptrain.init_distributed()
    torch.backends.cudnn.deterministic = True  # conv gradients without atomics: comparable bits
    torch.manual_seed(0)
    base = toy_models.make("lenet_nodrop").to(info.device)
    module = copy.deepcopy(base)
    models = (
        DistributedDataParallel(copy.deepcopy(base)),
        FullyShardedDataParallel(module, units=[module.conv2, module.fc1]),
    )
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in models]
    for model, opt in zip(models, opts, strict=True):
        for step in range(10):
            x, y = toy_models.batch("lenet", step, info.rank)
            opt.zero_grad()
            F.nll_loss(model(x.to(info.device)), y.to(info.device)).backward()
            opt.step()
    plain, whole = models[0].module.state_dict(), models[1].state_dict()
    moments = models[1].optim_state_dict(opts[1])["state"].values()
    tensors = list(whole.values()) + [v for s in moments for v in s.values() if v.dim()]
    return {
        "max_diff": max((whole[k] - plain[k]).abs().max().item() for k in plain),
        "devices": sorted({str(t.device) for t in tensors}),
    }


@pytest.mark.parametrize("world_size", [1, 2])
def test_fully_sharded_on_cuda_equals_the_ddp_wrapper(world_size):
    """ZeRO-3 on CUDA equals the DDP wrapper bitwise over 10 AdamW steps, its states on the GPU."""
    if torch.cuda.device_count() < world_size:
        pytest.skip(f"needs {world_size} GPUs")
    for r in ddptrain.spawn(_run_fully_sharded, world_size, timeout_s=300):
        assert r["max_diff"] == 0.0 and all(d.startswith("cuda") for d in r["devices"]), r


def _run_precision_trainer(precision: str) -> dict:
    cfg = TrainerConfig(global_batch_size=12, epochs=2, precision=precision, progress_bar=False)
    return toy_models.ToyTrainer(cfg).fit()


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_mixed_precision_trainer_on_cuda(precision):
    """precision='fp16' (with a GradScaler) and 'bf16' train on CUDA to finite metrics."""
    summary = ddptrain.spawn(_run_precision_trainer, 1, precision, timeout_s=300)[0]
    assert summary["step"] == 16
    assert summary["eval"]["eval_samples"] == toy_models.N_EVAL
    assert math.isfinite(summary["train_loss"]) and summary["train_loss"] > 0


def test_crash_and_resume_on_cuda_is_bitwise_equal_to_uninterrupted(tmp_path):
    """With dropout drawn from the CUDA generator, a crashed run resumed ends bitwise equal."""
    base = TrainerConfig(
        global_batch_size=12,
        epochs=4,
        checkpoint_dir=str(tmp_path / "a"),
        checkpoint_every_steps=5,
        keep_last=10,
        progress_bar=False,
    )
    straight = ddptrain.spawn(toy_models.fit, 1, base, 0.3, timeout_s=300)[0]
    cfg = replace(base, checkpoint_dir=str(tmp_path / "b"), resume="auto")
    with pytest.raises(ddptrain.WorkerError, match="simulated crash"):
        ddptrain.spawn(toy_models.fit, 1, cfg, 0.3, 13, timeout_s=300)
    assert ckpt.latest_checkpoint(tmp_path / "b").name == ckpt.checkpoint_name(10)
    resumed = ddptrain.spawn(toy_models.fit, 1, cfg, 0.3, timeout_s=300)[0]
    assert resumed[0]["step"] == straight[0]["step"] == 32
    assert torch.equal(resumed[1], straight[1])


# The oracle is nn.BatchNorm2d in float64 on the same values, so what is left is our own float32
# rounding (the tolerances of tests/nn/test_sync_batchnorm.py): elementwise results to a
# few ulps of values of size ~10; weight/bias gradients are sums of ~1000 terms that cancel.
SBN_TOL = {
    "out": (1e-5, 1e-5),  # (rtol, atol)
    "dx": (1e-5, 1e-5),
    "dweight": (1e-5, 1e-4),
    "dbias": (1e-5, 1e-4),
    "running_mean": (1e-5, 1e-5),
    "running_var": (1e-5, 1e-5),
}


def _worst(a: torch.Tensor, b: torch.Tensor, name: str) -> float:
    """Largest |a - b| in units of the allowed atol + rtol * |b| (<= 1 passes)."""
    rtol, atol = SBN_TOL[name]
    return ((a.double() - b).abs() / (atol + rtol * b.abs())).max().item()


def _run_sync_batchnorm(channels_last: bool) -> dict:
    info = ddptrain.init_distributed()
    torch.manual_seed(0)
    ours = SyncBatchNorm(6).to(info.device)
    with torch.no_grad():
        ours.weight.uniform_(0.5, 2.0)
        ours.bias.uniform_(-1.0, 1.0)
    oracle = nn.BatchNorm2d(6).to(info.device, torch.float64)
    oracle.load_state_dict(ours.state_dict())
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    worst: dict[str, float] = dict.fromkeys(SBN_TOL, 0.0)
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        # Offset 20: a mean far from zero is where a one-pass variance would lose digits.
        x = (torch.randn(16, 6, 9, 7, generator=g) * 2 + 20).to(info.device, memory_format=fmt)
        dy = torch.randn(16, 6, 9, 7, generator=g).to(info.device, memory_format=fmt)
        outs = []
        for bn, dtype in ((ours, torch.float32), (oracle, torch.float64)):
            xi = x.to(dtype, copy=True).requires_grad_(True)
            y = bn(xi)
            y.backward(dy.to(dtype))
            outs.append((y, xi.grad, bn.weight.grad, bn.bias.grad))
            bn.weight.grad = bn.bias.grad = None
        for name, a, b in zip(("out", "dx", "dweight", "dbias"), *outs, strict=True):
            worst[name] = max(worst[name], _worst(a, b, name))
    for name in ("running_mean", "running_var"):
        worst[name] = _worst(getattr(ours, name), getattr(oracle, name), name)
    batches = (ours.num_batches_tracked.item(), oracle.num_batches_tracked.item())
    return {"device": str(info.device), "worst": worst, "batches": batches}


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "channels_last"])
def test_sync_batchnorm_matches_batchnorm_on_cuda(channels_last):
    """SyncBatchNorm over NCCL equals float64 BatchNorm2d on CUDA to float32 rounding."""
    result = ddptrain.spawn(_run_sync_batchnorm, 1, channels_last, timeout_s=300)[0]
    assert result["device"].startswith("cuda")
    assert all(v <= 1.0 for v in result["worst"].values()), result["worst"]
    assert result["batches"] == (3, 3)


def _run_zero() -> dict:
    info = ddptrain.init_distributed()
    torch.manual_seed(0)
    base = toy_models.make("lenet_nodrop").to(info.device)
    models = [DistributedDataParallel(copy.deepcopy(base)) for _ in range(2)]
    zero = ZeroRedundancyOptimizer(models[0].parameters(), torch.optim.AdamW, lr=1e-3)
    plain = torch.optim.AdamW(models[1].parameters(), lr=1e-3)
    for step in range(5):
        x, y = toy_models.batch("lenet", step, info.rank)
        for model, opt in zip(models, (zero, plain), strict=True):
            opt.zero_grad()
            F.nll_loss(model(x.to(info.device)), y.to(info.device)).backward()
            opt.step()
    state = zero.state_dict()
    reloaded = torch.optim.AdamW(models[1].parameters(), lr=1e-3)
    reloaded.load_state_dict(state)
    moments = [
        (reloaded.state[p]["exp_avg_sq"] - plain.state[p]["exp_avg_sq"]).abs().max().item()
        for p in models[1].parameters()
    ]
    weights = [
        (a - b).abs().max().item()
        for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True)
    ]
    devices = {str(v.device) for s in state["state"].values() for v in s.values() if v.dim()}
    return {"weights": max(weights), "moments": max(moments), "state_devices": sorted(devices)}


def test_zero_stage_1_on_cuda_equals_adamw_and_its_state_loads_into_adamw():
    """ZeRO-1 on CUDA steps bitwise like AdamW, and its state_dict loads into a plain AdamW."""
    result = ddptrain.spawn(_run_zero, 1, timeout_s=300)[0]
    assert result["weights"] == 0.0 and result["moments"] == 0.0, result
    assert all(d.startswith("cuda") for d in result["state_devices"]), result


# Same bits at any world size on CUDA: 4 micro-batches of 8 a step, LeNet with BatchNorm and
# dropout, AdamW. One GPU holds every rank: world size 1 over NCCL, 2 and 4 over gloo with the
# tensors on the GPU (NCCL refuses two ranks on one device).
DET_MICRO, DET_MICRO_BATCHES, DET_STEPS = 8, 4, 3


def _run_deterministic(backend: str) -> dict:
    info = ddptrain.init_distributed(backend=backend)
    device = torch.device("cuda", 0)
    pin_kernels(device)
    torch.manual_seed(0)
    net = LeNet(dropout=0.3, width=1, batchnorm=True).to(device)
    initial = net.conv1.weight.detach().clone()
    model = DistributedDataParallel(net, deterministic=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(5)
    n = DET_MICRO * DET_MICRO_BATCHES * DET_STEPS
    x, y = torch.randn(n, 1, 28, 28, generator=g), torch.randint(0, 10, (n,), generator=g)
    rounds = DET_MICRO_BATCHES // info.world_size
    for step in range(DET_STEPS):
        opt.zero_grad(set_to_none=True)
        for j in range(rounds):
            k = step * DET_MICRO_BATCHES + j * info.world_size + info.rank
            xb = x[k * DET_MICRO : (k + 1) * DET_MICRO].to(device)
            yb = y[k * DET_MICRO : (k + 1) * DET_MICRO].to(device)
            with model.no_sync() if j < rounds - 1 else contextlib.nullcontext():
                F.nll_loss(model(xb), yb).backward()
        opt.step()
    state = net.state_dict()
    tensors = [state[k] for k in sorted(state)]
    tensors += [t for s in opt.state_dict()["state"].values() for t in s.values() if t.dim()]
    digest = hashlib.sha256()
    for t in tensors:
        digest.update(t.detach().cpu().contiguous().numpy().tobytes())
    return {
        "digest": digest.hexdigest(),
        "devices": sorted({str(t.device) for t in tensors}),
        "trained": bool((net.conv1.weight != initial).any()),
    }


def test_deterministic_mode_gives_the_same_bits_twice_on_cuda():
    """deterministic=True on CUDA: two runs with BatchNorm and dropout end bitwise the same."""
    first, second = (ddptrain.spawn(_run_deterministic, 1, "nccl", timeout_s=300)[0] for _ in "ab")
    assert first["trained"] and all(d.startswith("cuda") for d in first["devices"]), first
    assert first["digest"] == second["digest"]


@pytest.mark.parametrize("world_size", [2, 4])
def test_deterministic_mode_on_cuda_ends_alike_however_the_micro_batches_are_grouped(world_size):
    """deterministic=True on CUDA: 4 micro-batches on one rank end bitwise as on 2 or 4 ranks."""
    one = ddptrain.spawn(_run_deterministic, 1, "nccl", timeout_s=300)[0]
    # Every rank's LOCAL_RANK 0: all of them on the one GPU.
    shared = ddptrain.spawn(
        _run_deterministic, world_size, "gloo", timeout_s=300, env={"LOCAL_RANK": "0"}
    )
    assert all(r["trained"] for r in shared)
    assert [r["digest"] for r in shared] == [one["digest"]] * world_size


def test_the_deterministic_trainer_gives_the_same_bits_twice_on_cuda():
    """TrainerConfig(deterministic=True) on CUDA: two runs with dropout end bitwise the same."""
    # The Trainer turns on torch's deterministic algorithms itself.
    cfg = TrainerConfig(
        global_batch_size=12,
        micro_batch_size=3,
        deterministic=True,
        epochs=2,
        progress_bar=False,
    )
    runs = [ddptrain.spawn(toy_models.fit, 1, cfg, 0.3, timeout_s=300)[0] for _ in "ab"]
    (first, first_params), (second, second_params) = runs
    assert first["step"] == 16 and math.isfinite(first["train_loss"])
    assert torch.equal(first_params, second_params)
    assert first["train_loss"] == second["train_loss"]
