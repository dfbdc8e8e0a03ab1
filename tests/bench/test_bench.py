"""The benchmark's smoke mode and its pure summary (speed is judged by the benchmark itself)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from ddptrain.bench import compression
from ddptrain.bench import report as bench_report
from ddptrain.bench import steps as bench
from ddptrain.bench.models import MODELS


def test_quick_run_writes_the_expected_json(tmp_path):
    """--quick runs every variant on LeNet at world size 2 and writes a complete bench.json."""
    result = bench.main(["--quick", "--sync-only", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "bench.json").read_text())
    assert saved == json.loads(json.dumps(result))
    assert saved["settings"]["world_size"] == 2 and saved["settings"]["backend"] == "gloo"
    assert saved["settings"]["launcher"] == "spawn"
    assert [h["ranks"] for h in saved["settings"]["hosts"]] == [[0, 1]]
    one_host = "shared_memory" if os.access("/dev/shm", os.W_OK) else "tcp"
    assert saved["settings"]["bucket_transport"] == one_host
    lenet = saved["models"]["lenet"]
    expected = list(bench.BASE_VARIANTS) + [f"ddptrain_{e}" for e in bench.EXTRAS]
    assert list(lenet["variants"]) == [*expected, bench.SYNC_ONLY]
    for name, row in lenet["variants"].items():
        assert row["median_ms"] > 0 and row["cpu_ms"] > 0, name
        assert row["p25_ms"] <= row["median_ms"] <= row["p75_ms"], name
    assert lenet["variants"]["torch_ddp"]["vs_torch_ddp"] == 1.0
    assert lenet["variants"]["local"]["exposed_comm_ms"] is None
    model = MODELS["lenet"][0]()
    assert lenet["comm_alone_ms"] > 0
    assert lenet["params"] == sum(p.numel() for p in model.parameters())
    [ring] = saved["ring"]
    assert ring["size_mb"] == 1 and ring["ring_gbps"] > 0 and ring["backend_gbps"] > 0
    if "shm_ms" in ring:  # one host with /dev/shm: the bound is timed beside it
        assert ring["add_copy_gbps"] > 0
        assert ring["shm_vs_bound"] == pytest.approx(ring["shm_ms"] / ring["add_copy_ms"])
    pytest.importorskip("matplotlib")
    assert (tmp_path / "bench.png").stat().st_size > 10_000


def test_quick_run_times_the_compression_variants(tmp_path):
    """--quick times the three PowerSGD extras; ddptrain's sends fewer elements than it has."""
    extras = ",".join(compression.EXTRAS)
    argv = ["--quick", "--no-plot", "--ring-reps", "0", "--extras", extras]
    result = bench.main([*argv, "--out", str(tmp_path)])
    lenet = result["models"]["lenet"]
    assert list(lenet["variants"]) == [*bench.BASE_VARIANTS, *compression.EXTRAS.values()]
    for name, row in lenet["variants"].items():
        assert row["median_ms"] > 0 and row["samples_per_s"] > 0, name
    total, sent = lenet["powersgd_elements"]["ddptrain_powersgd"]
    assert total == lenet["params"] and 0 < sent < total
    assert result["settings"]["powersgd_rank"] == compression.DEFAULT_RANK


def _raw(rank_scale: float) -> dict:
    steps = {"torch_ddp": [0.010, 0.012, 0.011], "local": [0.005, 0.006, 0.005]}
    steps["ddptrain"] = [0.008, 0.009, 0.010]
    steps["comm_alone"] = [0.004, 0.004, 0.004]
    timings = {v: [t * rank_scale for t in ts] for v, ts in steps.items()}
    return {
        "models": {"m": {"timings": timings, "cpu": timings, "params": 3, "bucket_bytes": [12]}},
        "ring": {
            "ring": {1: [0.002, 0.002]},
            "backend": {1: [0.001, 0.001]},
            "shm": {1: [0.0006, 0.0004]},
            "add_copy": {1: [0.0004, 0.0004]},
        },
    }


def test_summary_takes_the_slowest_rank_then_the_median():
    """Step time is the slowest rank's; ratios, samples/s, exposed comm, bandwidth use medians."""
    settings = {"world_size": 2, "batch_size_per_rank": {"m": 11}}
    result = bench_report.summarize([_raw(1.0), _raw(2.0)], settings)
    m = result["models"]["m"]["variants"]
    assert m["torch_ddp"]["median_ms"] == pytest.approx(22.0)
    # 11 samples per rank x 2 ranks in a 22 ms step
    assert m["torch_ddp"]["samples_per_s"] == pytest.approx(1000.0)
    assert m["ddptrain"]["median_ms"] == pytest.approx(18.0)
    assert m["ddptrain"]["vs_torch_ddp"] == pytest.approx(18 / 22)
    assert m["ddptrain"]["exposed_comm_ms"] == pytest.approx(18.0 - 10.0)
    assert result["models"]["m"]["hidden_fraction"] == pytest.approx(1 - 8.0 / 8.0)
    [ring] = result["ring"]
    assert ring["ring_vs_backend"] == pytest.approx(0.5)
    # The median over repetitions of the slowest rank: shm 0.6 and 0.4 ms -> 0.5; bound 0.4.
    assert ring["shm_vs_bound"] == pytest.approx(0.5 / 0.4)
    assert "ddptrain" in bench_report.format_table(result)


def test_lenet_recipe_model_is_the_recipes_default_model_and_batch():
    """--models lenet-recipe times what recipes/mnist.py builds by default, at its ws=2 batch."""
    from ddptrain.bench.recipe import _load_recipe

    mnist = _load_recipe()
    flags = mnist.parse_args([])
    expected = mnist.MNISTTrainer(mnist.build_config(flags), flags).build_model()
    build, shape, batch, _ = MODELS["lenet-recipe"]
    model = build()
    assert repr(model) == repr(expected)
    for (name, p), q in zip(model.named_parameters(), expected.parameters(), strict=True):
        assert p.shape == q.shape and p.stride() == q.stride(), name  # channels_last alike
    assert batch == flags.global_batch_size // 2
    assert shape == (1, 28, 28)


ZEN1 = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 23
model\t\t: 1
model name\t: AMD EPYC
stepping\t: 2
flags\t\t: fpu sse2 avx fma avx2 sha_ni

processor\t: 1
model name\t: another CPU
"""
SAPPHIRE = "model name\t: Intel(R) Xeon(R) Processor\ncpu family\t: 6\nmodel\t\t: 143\n"
SAPPHIRE += "stepping\t: 8\nflags\t\t: avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n"


def test_cpu_description_tells_apart_vms_with_the_same_model_name():
    """The first CPU's family/model/stepping and kernel flags are kept, in KERNEL_FLAGS order."""
    zen1 = bench_report.cpu_description(ZEN1)
    assert zen1 == {
        "cpu": "AMD EPYC",
        "cpu_id": "family 23 model 1 stepping 2",
        "cpu_flags": ["avx2"],
    }
    xeon = bench_report.cpu_description(SAPPHIRE)
    assert xeon["cpu_id"] == "family 6 model 143 stepping 8"
    assert xeon["cpu_flags"] == ["avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"]
    assert bench_report.cpu_description("") == {"cpu": None, "cpu_id": None, "cpu_flags": []}


def test_machine_records_the_kernels_torch_picked():
    """machine() names a CPU and the vector ISA torch dispatches to on this machine."""
    info = bench_report.machine()
    assert info["cpu"] and info["torch_cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert set(info["cpu_flags"]) <= set(bench_report.KERNEL_FLAGS)


def test_sharded_variants_run_and_are_paired_against_fully_shard(tmp_path):
    """--extras zero2,zero3,torch_fsdp time them, ZeRO-2 and ZeRO-3 paired against fully_shard."""
    args = ["--quick", "--extras", "zero2,zero3,torch_fsdp", "--ring-reps", "0", "--no-plot"]
    result = bench.main([*args, "--out", str(tmp_path)])
    lenet = result["models"]["lenet"]
    assert list(lenet["variants"]) == [*bench.BASE_VARIANTS, *bench.SHARDED_EXTRAS]
    assert all(lenet["variants"][v]["median_ms"] > 0 for v in bench.SHARDED_EXTRAS)
    assert set(lenet["vs_torch_fsdp_paired"]) == {"zero2", "zero3"}
    assert "zero3 / torch_fsdp step time, paired median" in bench_report.format_table(result)
