"""PowerSGD: ddptrain's hook against torch's powerSGD_hook, and torch's hook on the wrapper.

One spawned world of 2 ranks runs every multi-process case (worlds.fixture); the pure helpers
(matrix views, orthogonalization, which gradients are worth compressing) run here.
"""

from __future__ import annotations

import copy
import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_psgd

from ddptrain.comm import named_hook
from ddptrain.compress import powersgd
from ddptrain.compress.powersgd import PowerSGDState, powersgd_hook
from ddptrain.cpu.tcp import Socket
from ddptrain.ddp.wrapper import DistributedDataParallel
from ddptrain.nn.sync_batchnorm import convert_sync_batchnorm
from ddptrain.train import build
from ddptrain.train.config import ConfigError, TrainerConfig
from support import worlds

WORLD_SIZE = 2
STEPS = 10
START_STEP = 3
# Three buckets for _mlp: [out, the hidden bias], [the hidden weight], [the first layer].
BUCKET_CAP_MB = 0.004
# ddptrain's hook against torch's, 10 SGD steps (7 compressed) of a tanh MLP from the same
# weights, buckets and random Qs. At world size 2 every sum is a + b in both; what differs is
# rounding: ddptrain multiplies the transposed matrices (Q^T M^T, P^T M, P Q^T in row blocks:
# other kernels, other summation orders), and keeps no error for the uncompressed gradients
# (torch's sums to zero over ranks: it adds rounding only). Each step's differences are a few
# ulps of gradients <= 1, carried by lr 0.1 and momentum gain <= 10 over 10 steps: well under
# 1e-5. Measured 3.0e-8 (rank 2) and 6.7e-8 (rank 4) on a 2-core AMD EPYC; the compressed runs
# are 2.2e-2 and 9.8e-3 from the uncompressed one, so the bound still tells them apart.
TORCH_ATOL = 1e-5


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(48, 96), nn.Tanh(), nn.Linear(96, 96), nn.Tanh(), nn.Linear(96, 10)
    )


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(16, 48, generator=g), torch.randint(0, 10, (16,), generator=g)


def _params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _train(model: nn.Module, rank: int, steps: int = STEPS, before_step=None) -> torch.Tensor:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(steps):
        x, y = _batch(rank, step)
        if before_step is not None:
            x = before_step(x)
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    return _params(model)


def _torch_state(rank: int, **options) -> torch_psgd.PowerSGDState:
    return torch_psgd.PowerSGDState(
        process_group=None,
        matrix_approximation_rank=rank,
        start_powerSGD_iter=START_STEP,
        **options,
    )


# ------------------------------------------------------------------------------ cases
def _case_equal_to_torch(info) -> dict:
    """Rank 2 (Gram-Schmidt) and 4 (QR), through the default transport and TCP: ddptrain's
    hook and torch's on the same wrapper, buckets and seed; and the uncompressed run."""
    out = {}
    for rank in (2, 4):
        theirs = DistributedDataParallel(_mlp(), bucket_cap_mb=BUCKET_CAP_MB)
        theirs.register_comm_hook(_torch_state(rank), torch_psgd.powerSGD_hook)
        out[f"torch_r{rank}"] = _train(theirs, info.rank)
        for transport in ("default", "tcp"):
            state = PowerSGDState(
                matrix_rank=rank,
                start_step=START_STEP,
                transport=Socket() if transport == "tcp" else None,
            )
            ours = DistributedDataParallel(
                _mlp(), bucket_cap_mb=BUCKET_CAP_MB, comm_hook=(state, powersgd_hook)
            )
            out[f"ours_r{rank}_{transport}"] = _train(ours, info.rank)
            out[f"elements_r{rank}"] = state.elements_per_step()
            out["buckets"] = len(ours.bucket_sizes_bytes)
    plain = DistributedDataParallel(
        _mlp(), bucket_cap_mb=BUCKET_CAP_MB, comm_hook=named_hook("allreduce")
    )
    out["uncompressed"] = _train(plain, info.rank)
    return out


# ddptrain's option -> torch's, each turned off.
OPTIONS = {"warm_start": "warm_start", "error_feedback": "use_error_feedback"}


def _case_options(info) -> dict:
    """Rank 2 with warm start, then error feedback, turned off: ddptrain's hook and torch's."""
    out = {}
    for ours_name, torch_name in OPTIONS.items():
        theirs = DistributedDataParallel(_mlp(), bucket_cap_mb=BUCKET_CAP_MB)
        theirs.register_comm_hook(_torch_state(2, **{torch_name: False}), torch_psgd.powerSGD_hook)
        state = PowerSGDState(matrix_rank=2, start_step=START_STEP, **{ours_name: False})
        ours = DistributedDataParallel(
            _mlp(), bucket_cap_mb=BUCKET_CAP_MB, comm_hook=(state, powersgd_hook)
        )
        out[ours_name] = {"torch": _train(theirs, info.rank), "ours": _train(ours, info.rank)}
    return out


def _case_uncompressed_phase(info) -> dict:
    """Before start_step: every bucket averaged as it is."""
    state = PowerSGDState(matrix_rank=2, start_step=STEPS + 1)
    ours = DistributedDataParallel(
        _mlp(), bucket_cap_mb=BUCKET_CAP_MB, comm_hook=(state, powersgd_hook)
    )
    plain = DistributedDataParallel(
        _mlp(), bucket_cap_mb=BUCKET_CAP_MB, comm_hook=named_hook("allreduce")
    )
    return {"ours": _train(ours, info.rank), "plain": _train(plain, info.rank)}


def _case_torch_hook_overlaps(info) -> dict:
    """torch's PowerSGD over several buckets. Backward, about to compute the input's gradient
    (last), waits for bucket 0's hook to start; the hook waits for that gradient: so the two
    meet only if the hook runs on another thread while backward goes on."""
    bucket_0_started, input_grad_done = threading.Event(), threading.Event()
    seen, threads = [], []

    def hook(state, bucket):
        threads.append((bucket.index(), bucket.is_last(), threading.current_thread().name))
        if bucket.index() == 0:
            bucket_0_started.set()
            input_grad_done.wait(timeout=20)
        return torch_psgd.powerSGD_hook(state, bucket)

    def on_input_grad(grad: torch.Tensor) -> None:
        seen.append(bucket_0_started.wait(timeout=20))
        input_grad_done.set()

    def watch_input(x: torch.Tensor) -> torch.Tensor:
        bucket_0_started.clear()
        input_grad_done.clear()
        x = x.clone().requires_grad_()
        x.register_hook(on_input_grad)
        return x

    model = DistributedDataParallel(_mlp(), bucket_cap_mb=BUCKET_CAP_MB)
    model.register_comm_hook(_torch_state(2), hook)
    params = _train(model, info.rank, before_step=watch_input)
    return {"params": params, "seen": seen, "threads": threads}


def _case_pair_equals_register(info) -> dict:
    """comm_hook=(state, hook) is register_comm_hook(state, hook); a second one is refused."""
    paired = DistributedDataParallel(
        _mlp(), comm_hook=(PowerSGDState(matrix_rank=2, start_step=2), powersgd_hook)
    )
    registered = DistributedDataParallel(_mlp())
    registered.register_comm_hook(PowerSGDState(matrix_rank=2, start_step=2), powersgd_hook)
    try:
        paired.register_comm_hook(None, powersgd_hook)
        again = "no error"
    except RuntimeError as e:
        again = str(e)
    by_name = DistributedDataParallel(_mlp(), comm_hook=named_hook("powersgd"))
    state = by_name.comm_hook[0]
    return {
        "paired": _train(paired, info.rank),
        "registered": _train(registered, info.rank),
        "again": again,
        "by_name": (type(state).__name__, state.matrix_rank, state.start_step),
    }


class _ConvNet(nn.Module):
    """Two convolutions and a BatchNorm: channels_last weights, and SyncBatchNorm's backward
    collectives."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv1 = nn.Conv2d(3, 16, 3)
        self.bn = nn.BatchNorm2d(16)
        self.conv2 = nn.Conv2d(16, 32, 3)
        self.fc = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn(self.conv1(x)))
        return self.fc(F.relu(self.conv2(x)).mean((2, 3)))


def _case_sync_batchnorm_and_channels_last(info) -> dict:
    """A channels_last model with SyncBatchNorm on the default group, ddptrain's PowerSGD (its
    sums on a transport of its own), several buckets."""
    module = convert_sync_batchnorm(_ConvNet()).to(memory_format=torch.channels_last)
    state = PowerSGDState(matrix_rank=2, start_step=2)
    model = DistributedDataParallel(module, bucket_cap_mb=0.005, comm_hook=(state, powersgd_hook))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for step in range(12):
        g = torch.Generator().manual_seed(100 * info.rank + step % 3)
        x = torch.randn(8, 3, 10, 10, generator=g).to(memory_format=torch.channels_last)
        y = torch.randint(0, 10, (8,), generator=g)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    conv2 = module.conv2.weight
    refused = "no error"
    try:
        theirs = DistributedDataParallel(copy.deepcopy(module))
        theirs.register_comm_hook(_torch_state(2), torch_psgd.powerSGD_hook)
    except ValueError as e:
        refused = str(e)
    return {
        "params": _params(model),
        "losses": losses,
        "buckets": len(model.bucket_sizes_bytes),
        "channels_last": conv2.is_contiguous(memory_format=torch.channels_last),
        "compressed": state.elements_per_step(),
        "torch_refused": refused,
    }


def _case_trainer_config(info) -> dict:
    """TrainerConfig's powersgd fields reach the wrapper's hook."""
    cfg = TrainerConfig(comm_hook="powersgd", powersgd_rank=3, powersgd_start_step=7)
    state, hook = build.wrap_model(cfg, _mlp()).comm_hook
    return {"options": (state.matrix_rank, state.start_step), "hook": hook is powersgd_hook}


CASES = {
    "equal_to_torch": _case_equal_to_torch,
    "options": _case_options,
    "uncompressed_phase": _case_uncompressed_phase,
    "torch_hook_overlaps": _case_torch_hook_overlaps,
    "pair_equals_register": _case_pair_equals_register,
    "sync_batchnorm_and_channels_last": _case_sync_batchnorm_and_channels_last,
    "trainer_config": _case_trainer_config,
}
world = worlds.fixture(CASES, {WORLD_SIZE: list(CASES)}, timeout_s=300)


# ------------------------------------------------------------------------------ tests
@pytest.mark.parametrize("rank", [2, 4])
def test_powersgd_equals_torchs_within_rounding(world, rank):
    """PowerSGD ends within TORCH_ATOL of torch's powerSGD_hook, over shared memory and TCP."""
    # Both must end far from the uncompressed run, so the compression really ran.
    for r in worlds.outcome(world(WORLD_SIZE), "equal_to_torch"):
        assert r["buckets"] >= 3
        theirs = r[f"torch_r{rank}"]
        for transport in ("default", "tcp"):
            ours = r[f"ours_r{rank}_{transport}"]
            diff = (ours - theirs).abs().max().item()
            print(f"rank {rank}, {transport}: max |ours - torch's| = {diff:.3g}")
            assert diff <= TORCH_ATOL, (transport, diff)
        apart = (theirs - r["uncompressed"]).abs().max().item()
        print(f"rank {rank}: max |torch's - uncompressed| = {apart:.3g}")
        assert apart > 100 * TORCH_ATOL
        total, sent = r[f"elements_r{rank}"]
        assert total == sum(p.numel() for p in _mlp().parameters()) and sent < total / 4


@pytest.mark.parametrize("option", list(OPTIONS))
def test_powersgd_options_turned_off_equal_torchs(world, option):
    """With warm start or error feedback off, PowerSGD is within TORCH_ATOL of torch's likewise."""
    # Both must end far from the run with every option on, so the option made a difference.
    for r in worlds.outcome(world(WORLD_SIZE), "options"):
        ours, theirs = r[option]["ours"], r[option]["torch"]
        diff = (ours - theirs).abs().max().item()
        print(f"{option} off: max |ours - torch's| = {diff:.3g}")
        assert diff <= TORCH_ATOL, (option, diff)
    for r_opts, r_eq in zip(
        worlds.outcome(world(WORLD_SIZE), "options"),
        worlds.outcome(world(WORLD_SIZE), "equal_to_torch"),
        strict=True,
    ):
        apart = (r_opts[option]["torch"] - r_eq["torch_r2"]).abs().max().item()
        print(f"{option} off: max |it - every option on| = {apart:.3g}")
        assert apart > 100 * TORCH_ATOL, (option, apart)


def test_before_start_step_buckets_are_averaged_uncompressed(world):
    """Before start_step buckets are averaged uncompressed: bitwise the all_reduce transport."""
    for r in worlds.outcome(world(WORLD_SIZE), "uncompressed_phase"):
        assert torch.equal(r["ours"], r["plain"])


def test_torchs_powersgd_runs_overlapped_over_several_buckets(world):
    """torch's powerSGD_hook over 3 buckets overlaps backward on gloo; replicas bitwise equal."""
    # Bucket 0's hook runs on the comm thread during backward, the last bucket's on the waiting one.
    results = worlds.outcome(world(WORLD_SIZE), "torch_hook_overlaps")
    for r in results:
        assert r["seen"] == [True] * STEPS
        assert {index for index, _, _ in r["threads"]} == set(range(3))
        for index, is_last, thread in r["threads"]:
            if index == 0:
                assert thread == "ddptrain-comm"
            if is_last:
                assert thread == "MainThread"
        assert torch.equal(r["params"], results[0]["params"])


def test_hook_pair_is_register_comm_hook_and_names_build_the_default(world):
    """comm_hook=(state, hook) is register_comm_hook bitwise; "powersgd" is rank 4 from step 100."""
    for r in worlds.outcome(world(WORLD_SIZE), "pair_equals_register"):
        assert torch.equal(r["paired"], r["registered"])
        assert "can only be called once" in r["again"]
        assert r["by_name"] == ("PowerSGDState", 4, 100)


def test_powersgd_beside_sync_batchnorm_on_channels_last_weights(world):
    """Beside SyncBatchNorm, PowerSGD compresses channels_last conv weights; replicas stay equal."""
    # Its sums use a transport of its own; torch's hook on SyncBatchNorm's group is refused.
    results = worlds.outcome(world(WORLD_SIZE), "sync_batchnorm_and_channels_last")
    for r in results:
        assert r["buckets"] >= 2 and r["channels_last"]
        assert all(torch.isfinite(torch.tensor(r["losses"])))
        total, sent = r["compressed"]
        # conv2 (32 x 144 at rank 2) is compressed: fewer elements sent than gradients.
        assert sent < total
        assert "SyncBatchNorm" in r["torch_refused"]
        assert torch.equal(r["params"], results[0]["params"])


def test_trainer_config_options_reach_the_hook(world):
    """TrainerConfig's powersgd_rank and powersgd_start_step reach ddptrain's PowerSGD hook."""
    for r in worlds.outcome(world(WORLD_SIZE), "trainer_config"):
        assert r["options"] == (3, 7) and r["hook"]


# ------------------------------------------------------------------------------ pure
def test_channels_last_weight_is_read_as_a_matrix_in_place():
    """A channels_last conv gradient is an out_channels x rest view of its own memory."""
    grad = torch.randn(8, 3, 5, 5)
    last = grad.to(memory_format=torch.channels_last)
    matrix = powersgd._as_matrix(last)
    assert matrix.shape == (8, 75) and matrix.data_ptr() == last.data_ptr()
    for row, plain in zip(matrix, powersgd._as_matrix(grad), strict=True):
        assert torch.equal(row.sort().values, plain.sort().values)
    # dim 0 not outermost: no view, so the gradient is sent uncompressed
    assert powersgd._as_matrix(torch.randn(5, 8).t()) is None


@pytest.mark.parametrize("cols", [1, 2, 3, 4, 8])
def test_orthogonalize_matches_torchs(cols):
    """Orthonormal columns, equal to torch's _orthogonalize (float32 rounding, 1e-6)."""
    matrix = torch.randn(64, cols, generator=torch.Generator().manual_seed(cols))
    theirs = matrix.clone().unsqueeze(0)
    torch_psgd._orthogonalize(theirs)
    powersgd._orthogonalize(matrix, 0.0)
    torch.testing.assert_close(matrix, theirs[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(matrix.t() @ matrix, torch.eye(cols), rtol=0, atol=1e-5)


def test_which_gradients_are_compressed_follows_torch():
    """_worth_compressing agrees with torch's _should_compress for every shape and rank."""
    for n in (1, 3, 10, 64, 300):
        for m in (1, 5, 64, 784):
            for rank in (1, 2, 4, 8):
                theirs = torch_psgd._should_compress(n, m, min(n, m, rank), 2.0)[0]
                assert powersgd._worth_compressing(n, m, rank, 2.0) == theirs, (n, m, rank)


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"start_step": 1}, "start_step must be >= 2"),
        ({"matrix_rank": 0}, "matrix_rank must be a positive integer"),
    ],
)
def test_state_refuses_bad_options_with_the_reason(options, match):
    """PowerSGDState refuses a rank < 1 and, with error feedback, a start before step 2."""
    with pytest.raises(ValueError, match=match):
        PowerSGDState(**options)


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"powersgd_rank": 0}, "powersgd_rank=0: must be a positive integer"),
        ({"powersgd_start_step": 1}, "powersgd_start_step=1: must be >= 2"),
    ],
)
def test_config_refuses_bad_powersgd_options(overrides, match):
    """TrainerConfig names the bad PowerSGD option and its bound."""
    with pytest.raises(ConfigError, match=match):
        TrainerConfig(comm_hook="powersgd", **overrides)
