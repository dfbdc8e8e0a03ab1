"""The planner's CUDA path on a CPU: the meter over a stand-in for torch.cuda, the device
memory model, and the command line's device handling (tests/test_gpu.py-style runs on a GPU
are in test_plan_gpu.py)."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

import ddptrain
from ddptrain.plan import __main__ as cli
from ddptrain.plan import check
from ddptrain.plan.marks import Marks, activation_bytes
from ddptrain.plan.meter import CpuMeter, CudaMeter
from ddptrain.plan.predict import peak_memory, predict
from ddptrain.plan.profile import MAX_TIMED_STEPS, TIMED_STEPS, _enough
from ddptrain.plan.setup import Setup
from support.fake_cuda import FakeCuda, measure_with_fake_cuda
from support.plan_profiles import MIB, bus, ddp_profile


def test_cuda_meter_times_between_events_read_after_a_synchronize():
    """CudaMeter synchronizes at start and finish; stamps read their events' elapsed time."""
    cuda = FakeCuda()
    meter = CudaMeter(cuda)
    meter.start()
    assert cuda.calls == ["synchronize", "record"]
    a = meter.stamp()
    time.sleep(0.010)
    b = meter.stamp()
    with pytest.raises(RuntimeError, match="completed"):
        meter.seconds(b)
    meter.finish()
    assert meter.seconds(b) - meter.seconds(a) >= 0.010
    assert 0.0 <= meter.seconds(a) < meter.seconds(b)


def test_cuda_meter_peak_is_the_allocators_after_a_reset():
    """The peak is max_memory_allocated after reset_peak_memory_stats, each behind a synchronize."""
    # The synchronize makes the device's queued work count.
    cuda = FakeCuda(peak_bytes=7 * MIB, allocated_bytes=3)
    meter = CudaMeter(cuda)
    assert meter.reset_peak()
    assert meter.peak_bytes() == 7 * MIB and meter.allocated_bytes() == 3
    assert cuda.calls == ["synchronize", "reset_peak_memory_stats", "synchronize",
                          "max_memory_allocated", "synchronize", "memory_allocated"]  # fmt: skip


@pytest.fixture(scope="module")
def fake_cuda_profiles():
    """LeNet's DDP and ZeRO-3 profiles measured through the CUDA meter over the stand-in."""
    setups = [Setup(model="lenet", strategy=s).as_dict() for s in ("ddp", "zero3")]
    (found,) = ddptrain.spawn(measure_with_fake_cuda, 1, setups, 5 * MIB, 1234, timeout_s=240)
    return dict(zip(("ddp", "zero3"), found, strict=True))


@pytest.mark.parametrize("strategy", ["ddp", "zero3"])
def test_profile_through_the_cuda_meter(fake_cuda_profiles, strategy):
    """The CUDA profile on CPU: spans sum to the step, marks lie in backward, allocator memory."""
    # The stand-in raises, as CUDA does, on an event read before a synchronize.
    prof, calls = fake_cuda_profiles[strategy]
    assert prof["forward_s"] > 0 and prof["backward_s"] > 0 and prof["optimizer_s"] > 0
    parts = prof["forward_s"] + prof["backward_s"] + prof["optimizer_s"]
    assert parts == pytest.approx(prof["step_s"], rel=0.05)
    marks = prof["bucket_ready_s"] if strategy == "ddp" else prof["ready_s"]
    assert marks and all(0.0 <= t <= prof["backward_s"] for t in marks)
    if strategy == "zero3":
        assert all(0.0 <= a <= b <= prof["forward_s"] for a, b in prof["unit_forward_s"])
    assert prof["peak_rss_bytes"] == 5 * MIB and prof["rss_before_model_bytes"] == 1234
    assert calls.index("reset_peak_memory_stats") < calls.index("max_memory_allocated")
    assert prof["timed_steps"] == TIMED_STEPS  # no wall time asked: the fewest steps
    # The strategy's own step is timed unmarked too; the DDP wrapper's spans are scaled to it
    # (the tick clock makes every event a millisecond: the marked step is the longer).
    assert prof["wrapper_step_s"] > 0
    if strategy == "ddp":
        assert prof["marks_scale"] < 1.0
        assert prof["step_s"] == pytest.approx(prof["wrapper_step_s"])
    else:
        assert prof["marks_scale"] == 1.0 and prof["step_s"] > prof["wrapper_step_s"]


def test_profile_times_steps_until_the_wall_time_asked():
    """A profile asked for 1.5 s keeps stepping past TIMED_STEPS and stops by its count and time."""
    # LeNet's step is far shorter than 1.5 s / TIMED_STEPS.
    setups = [Setup(model="lenet", strategy="ddp").as_dict()]
    (found,) = ddptrain.spawn(measure_with_fake_cuda, 1, setups, MIB, 0, 1.5, timeout_s=240)
    prof = found[0][0]
    assert TIMED_STEPS < prof["timed_steps"] <= MAX_TIMED_STEPS
    assert not _enough(TIMED_STEPS - 1, 60.0, 1.5)
    assert not _enough(TIMED_STEPS, 1.4, 1.5) and _enough(TIMED_STEPS, 1.5, 1.5)
    assert _enough(MAX_TIMED_STEPS, 0.0, 1.5)


def _saving_toy() -> tuple[nn.Module, torch.Tensor]:
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)), torch.randn(3, 8)


class _SumLoss:
    def loss(self, out: torch.Tensor, _: torch.Tensor) -> torch.Tensor:
        return out.sum()


@pytest.mark.parametrize(("device", "expected"), [("cpu", (3 * 8 + 3 * 16) * 4), ("cuda", 0)])
def test_activations_count_the_storages_on_the_setups_device(device, expected):
    """Saved-tensor bytes count only the profiled device's storages: (3x8 + 3x16) float32 on CPU."""
    # Input and ReLU output only: the second Linear saves the ReLU's output storage again.
    model, x = _saving_toy()
    params = list(model.parameters())
    marks = Marks(CpuMeter(), model, params, [], param_hooks=False)
    total, _ = activation_bytes(model, _SumLoss(), x, x, params, marks, torch.device(device))
    assert total == expected


def _cuda_profile(**overrides: object):
    """A DDP profile on CUDA: P = 20 MiB, O = 40 MiB, A = 6 MiB, 9 MiB of workspace."""
    fields = {"device": "cuda", "rss_before_model_bytes": 0, "activation_bytes": 6 * MIB,
              "peak_rss_bytes": 2 * 20 * MIB + 40 * MIB + 6 * MIB + 9 * MIB}  # fmt: skip
    return ddp_profile(**{**fields, **overrides})


@pytest.mark.parametrize("world_size", [1, 2, 8])
def test_cuda_memory_model_against_the_closed_form(world_size):
    """A CUDA DDP peak is 2P + O + activations + workspace at any world size; ZeRO-1 holds O / n."""
    # The second P is the buckets the gradients are views of; there is no runtime baseline.
    prof, n = _cuda_profile(), world_size
    ddp = peak_memory(Setup(strategy="ddp", device="cuda"), prof, bus(), n)
    assert ddp == {"runtime": 0, "params": 20 * MIB, "grads": 20 * MIB, "optimizer": 40 * MIB,
                   "activations": 6 * MIB, "buffers": 0, "runtime_growth": 9 * MIB,
                   "peak": 95 * MIB}  # fmt: skip
    zero1 = peak_memory(Setup(strategy="zero1", device="cuda"), prof, bus(), n)
    assert zero1["optimizer"] == 40 * MIB // n
    assert zero1["peak"] == 95 * MIB - (40 * MIB - 40 * MIB // n)


def test_a_cuda_step_at_one_rank_is_its_profiled_spans():
    """At world size 1 on a GPU link the step is forward + backward + optimizer, any bandwidth."""
    prof = _cuda_profile()
    for link in (bus(), bus(bytes_per_s=1.0, latency_s=1.0)):
        (point,) = predict(Setup(strategy="ddp", device="cuda"), prof, link, [1]).points
        assert point.step_s == pytest.approx(0.010 + 0.020 + 0.002)


def _one_line_exit(argv: list[str]) -> str:
    with pytest.raises(SystemExit) as raised:
        cli.parse_args(argv)
    message = raised.value.code
    assert isinstance(message, str) and "\n" not in message and "error:" in message
    return message


def test_device_cuda_without_cuda_fails_in_one_line(monkeypatch):
    """--device cuda where torch sees no GPU exits with one error line naming the cause."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "is_available() is False" in _one_line_exit(["--device", "cuda"])
    assert cli.parse_args([]).device == "cpu"


def test_cuda_check_refuses_more_ranks_than_gpus(monkeypatch):
    """One GPU: --check at world size 2 is refused, paper planning is not; CPU links are refused."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    argv = ["--device", "cuda", "--world-sizes", "1,2"]
    assert "world sizes 2 need more than the 1 GPU" in _one_line_exit([*argv, "--check"])
    args = cli.parse_args(argv)
    assert (args.device, args.links, args.world_sizes) == ("cuda", ["nccl-100g"], [1, 2])
    assert "CPU links" in _one_line_exit([*argv, "--links", "local"])
    assert cli.parse_args([]).device == "cuda"
    with pytest.raises(ValueError, match="needs 2 GPUs"):
        check.run_local(Setup(device="cuda"), 2)


def test_cuda_check_runs_at_one_rank_and_compares(monkeypatch, tmp_path):
    """--device cuda --check at world size 1 runs each strategy once on CUDA and writes ratios."""
    import json

    import ddptrain.plan

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda _: "a stand-in GPU")
    profiled, ran = [], []
    monkeypatch.setattr(ddptrain.plan, "profile",
                        lambda setup: profiled.append(setup) or _cuda_profile())  # fmt: skip

    def run_local(setup, n, steps):
        ran.append((setup.device, n))
        return {"step_s": 0.040, "peak_bytes": 100 * MIB}

    monkeypatch.setattr(cli, "run_local", run_local)
    argv = ["--device", "cuda", "--models", "lenet", "--strategies", "ddp,zero1"]
    out = cli.main([*argv, "--world-sizes", "1", "--check", "--no-plot", "--out", str(tmp_path)])
    assert [s.device for s in profiled] == ["cuda", "cuda"] and ran == [("cuda", 1)] * 2
    rows = json.loads((tmp_path / "plan.json").read_text())["check"]
    assert [r["link"] for r in rows] == ["nccl-100g"] * 2 == [r["link"] for r in out["check"]]
    assert rows[0]["step_ratio"] == pytest.approx(0.032 / 0.040)
    assert rows[0]["peak_ratio"] == pytest.approx(95 / 100)
    assert rows[0]["background_threads"] == 0.0


def test_check_repeats_take_turns_within_a_world_size(monkeypatch, tmp_path):
    """--check --rounds 2 runs each strategy twice per world size, the second pass in reverse."""
    import ddptrain.plan

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda _: "a stand-in GPU")
    monkeypatch.setattr(ddptrain.plan, "profile", lambda setup: _cuda_profile())
    ran = []

    def run_local(setup, n, steps):
        ran.append((setup.strategy, n))
        block = 0.010 * len(ran)
        return {"step_s": block, "block_step_s": [block] * 3, "peak_bytes": MIB,
                "rss_before_model_bytes": 0, "max_rss_bytes": MIB}  # fmt: skip

    monkeypatch.setattr(cli, "run_local", run_local)
    argv = ["--device", "cuda", "--models", "lenet", "--strategies", "ddp,zero1", "--rounds", "2"]
    out = cli.main([*argv, "--world-sizes", "1,2", "--check", "--no-plot", "--out", str(tmp_path)])
    assert ran == [("ddp", 1), ("zero1", 1), ("zero1", 1), ("ddp", 1)] + [
        ("ddp", 2),
        ("zero1", 2),
        ("zero1", 2),
        ("ddp", 2),
    ]
    rows = {r["configuration"].split()[1] + str(r["world_size"]): r for r in out["check"]}
    assert rows["ddp1"]["measured"]["round_step_s"] == pytest.approx([0.010, 0.040])
    assert rows["zero12"]["measured"]["round_step_s"] == pytest.approx([0.060, 0.070])
    assert rows["ddp2"]["measured_step_s"] == pytest.approx(0.065)  # 3x 0.05 and 3x 0.08
