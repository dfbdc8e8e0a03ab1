"""The whole-run comparison (--recipe) and the memory report (--memory): smoke runs and summaries.

Speed is judged by the benchmarks themselves; these check that each runs end to end and that
its JSON holds every figure, derived from the measured ones as documented.
"""

from __future__ import annotations

import json
import math

import pytest

from ddptrain.bench import memory, recipe, recipe_report
from ddptrain.models import MLP, LeNet

# The recipe's default model: LeNet width 2 with BatchNorm.
LENET_RECIPE_PARAMETERS = sum(p.numel() for p in LeNet(width=2, batchnorm=True).parameters())


def test_recipe_quick_run_reports_three_variants_and_their_ratios(tmp_path):
    """--recipe --quick at world size 2: positive samples/s for each variant, ratios from them."""
    result = recipe.main(["--recipe", "--quick", "--out", str(tmp_path), "--no-plot"])
    saved = json.loads((tmp_path / "recipe.json").read_text())
    assert saved == json.loads(json.dumps(result))
    assert saved["settings"]["world_size"] == 2 and saved["settings"]["data"] == "synthetic"
    rows = saved["variants"]
    assert list(rows) == list(recipe.VARIANTS)
    for name, row in rows.items():
        assert row["samples_per_s"] > 0, name
        assert len(row["per_rank"][0]) == 2, name
        # Every variant trained the same number of steps on the same per-rank batch.
        steps = saved["settings"]["steps"]
        batch = recipe._load_recipe().parse_args([]).global_batch_size // 2
        assert [r["samples"] for r in row["per_rank"][0]] == [steps * batch] * 2, name
        assert [r["parameters"] for r in row["per_rank"][0]] == [LENET_RECIPE_PARAMETERS] * 2
    ratios = saved["ratios"]
    rate = {v: row["samples_per_s"] for v, row in rows.items()}
    assert ratios["ddptrain_vs_standard"] == pytest.approx(rate["ddptrain"] / rate["standard"])
    assert ratios["ddptrain_vs_floor"] == pytest.approx(rate["ddptrain"] / rate["floor"])
    # The floor's processes timed their steps; the bound is a share of its rate.
    bound = saved["floor_lockstep_bound"]
    assert len(bound["runs"]) == 1 and 0 < bound["median"] <= 1, bound
    assert all("step_ends" not in r for row in rows.values() for r in row["per_rank"][0])


@pytest.mark.slow
def test_recipe_bench_trains_the_mlp_in_every_variant_when_asked(tmp_path):
    """--recipe-args "--model mlp": the standard stack and the floor train the MLP too."""
    args = ["--recipe", "--quick", "--out", str(tmp_path), "--no-plot", "--steps", "2"]
    result = recipe.main([*args, "--recipe-args", "--model mlp"])
    mlp = sum(p.numel() for p in MLP().parameters())
    assert result["settings"]["model"] == "mlp"
    for name, row in result["variants"].items():
        assert [r["parameters"] for r in row["per_rank"][0]] == [mlp] * 2, name


def test_recipe_args_take_a_lone_flag_and_bad_ones_fail_in_the_parent(capsys):
    """`--recipe-args --sync-batchnorm` parses; a misspelt recipe flag is one usage error (2)."""
    args = recipe.parse_args(["--recipe", "--quick", "--recipe-args", "--sync-batchnorm"])
    assert args.recipe_args == ["--sync-batchnorm"]
    with pytest.raises(SystemExit) as exited:
        recipe.parse_args(["--recipe", "--quick", "--recipe-args", "--widht 3"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "--recipe-args: unrecognized arguments: --widht 3" in err
    assert "Traceback" not in err


def test_recipe_world_size_that_does_not_split_the_batch_fails_in_the_parent(capsys):
    """--world-size 3 with batch 256 exits with status 2 before any rank starts; 252 is accepted."""
    with pytest.raises(SystemExit) as exited:
        recipe.parse_args(["--recipe", "--world-size", "3"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "--world-size 3: global_batch_size 256 is not divisible by world_size 3" in err
    assert "e.g. 255 or 258" in err and "--recipe-args" in err
    args = recipe.parse_args(
        ["--recipe", "--world-size", "3", "--recipe-args", "--global-batch-size 252"]
    )
    assert args.world_size == 3 and args.steps == math.ceil(60_000 / 252)


def test_recipe_summary_counts_sync_worlds_by_slowest_rank_and_sums_the_floor():
    """Synchronous variants: all samples / slowest wall time; floor: the sum of each rate."""
    run = {
        "ddptrain": [{"samples": 100, "wall_s": 1.0}, {"samples": 100, "wall_s": 2.0}],
        "standard": [{"samples": 100, "wall_s": 4.0}, {"samples": 100, "wall_s": 4.0}],
        "floor": [{"samples": 100, "wall_s": 1.0}, {"samples": 100, "wall_s": 2.0}],
    }
    second = {**run, "ddptrain": [{"samples": 100, "wall_s": 4.0}] * 2}
    result = recipe_report.summarize([run, second, run], {})
    assert result["variants"]["ddptrain"]["runs"] == [100.0, 50.0, 100.0]
    assert result["variants"]["ddptrain"]["samples_per_s"] == 100.0
    assert result["variants"]["floor"]["samples_per_s"] == 150.0
    assert result["ratios"] == {"ddptrain_vs_standard": 2.0, "ddptrain_vs_floor": 100 / 150}
    assert "ddptrain_vs_floor" in recipe_report.format_table(result)


def test_recipe_paired_ratio_is_the_median_of_each_repeats_ratio():
    """Paired: ratios taken within each repeat, then the median (not a ratio of medians)."""

    def run(ddptrain_wall_s: float, floor_wall_s: float) -> dict:
        return {
            "ddptrain": [{"samples": 100, "wall_s": ddptrain_wall_s}] * 2,
            "floor": [{"samples": 100, "wall_s": floor_wall_s}] * 2,
        }

    # ddptrain 100, 80, 60 samples/s against floors of 100, 200, 50: each repeat's ratio is
    # 1.0, 0.4, 1.2 (median 1.0), while the medians, 80 and 100, give 0.8.
    result = recipe_report.summarize([run(2.0, 2.0), run(2.5, 1.0), run(200 / 60, 4.0)], {})
    assert result["ratios"]["ddptrain_vs_floor"] == pytest.approx(0.8)
    assert result["paired"]["ddptrain_vs_floor"] == pytest.approx(1.0)
    assert "paired" in recipe_report.format_table(result)


def test_lockstep_bound_keeps_each_step_only_as_long_as_the_slowest_process():
    """The lockstep bound is 1 for equal traces or one process, less by out-of-phase excess."""
    assert recipe_report.lockstep_bound([[0, 1, 3, 4], [5, 6, 8, 9]]) == pytest.approx(1.0)
    # Steps of 1, 2, 1, 2 s against 2, 1, 2, 1 s: each process alone takes 6 s (together 1/3
    # step/s), in lockstep every step takes 2 s, 8 s for two processes' 4 steps (0.25 step/s).
    out_of_phase = [[0, 1, 3, 4, 6], [0, 2, 3, 5, 6]]
    assert recipe_report.lockstep_bound(out_of_phase) == pytest.approx(0.75)
    assert recipe_report.lockstep_bound([[0, 1, 3, 4, 6]]) == pytest.approx(1.0)
    assert recipe_report.lockstep_bound([[0, 1, 3, 4, 6, 100], [0, 2, 3, 5, 6]]) == pytest.approx(
        0.75
    )
    assert math.isnan(recipe_report.lockstep_bound([[0.0], [0.0, 1.0]]))


def test_recipe_summary_gives_the_floor_lockstep_bound_per_repeat():
    """The floor's lockstep bound per repeat, its median, a table line; none if ranks > cores."""

    def run(slow_step_s: float) -> dict:
        ends = [[0, 1, 1 + slow_step_s], [0, slow_step_s, 1 + slow_step_s]]
        return {"floor": [{"samples": 2, "wall_s": 1 + slow_step_s, "step_ends": e} for e in ends]}

    # Steps of 1 and s seconds out of phase: bound (2 / 2s) / (2 / (1 + s)) = (1 + s) / 2s.
    result = recipe_report.summarize([run(2.0), run(3.0), run(1.0)], {})
    assert result["floor_lockstep_bound"]["runs"] == pytest.approx([0.75, 2 / 3, 1.0])
    assert result["floor_lockstep_bound"]["median"] == pytest.approx(0.75)
    assert "step_ends" not in result["variants"]["floor"]["per_rank"][0][0]
    assert "floor_lockstep_bound: 0.750" in recipe_report.format_table(result)
    # More ranks than cores: the scheduler's time slices set the floor's steps; no bound.
    crowded = recipe_report.summarize([run(2.0)], {"world_size": 2, "machine": {"cpu_count": 1}})
    assert "floor_lockstep_bound" not in crowded
    assert "2 ranks share 1 cores" in recipe_report.format_table(crowded)
    roomy = {"world_size": 2, "machine": {"cpu_count": 2}}
    assert "floor_lockstep_bound" in recipe_report.summarize([run(2.0)], roomy)


def test_recipe_chart_title_names_the_model_and_the_flags_given():
    """The chart says MLP for --model mlp and lists any recipe flags; none given, none shown."""
    settings = {"data": "fashion-mnist", "world_size": 2, "steps": 235, "recipe_args": []}
    result = {"settings": settings, "ratios": {"ddptrain_vs_floor": 0.987}}
    assert recipe_report.chart_title(result) == (
        "LeNet, fashion-mnist, world size 2, 235 steps\nddptrain vs floor 0.99"
    )
    settings.update(model="mlp", recipe_args=["--model", "mlp", "--precision", "bf16"])
    first = recipe_report.chart_title(result).splitlines()[0]
    assert first == "MLP, fashion-mnist, world size 2, 235 steps (--model mlp --precision bf16)"


def test_per_sample_dataset_matches_the_bulk_normalized_one():
    """The standard stack's per-sample normalize gives the recipe's bulk-normalized samples."""
    split = recipe._train_images("synthetic", quick=True)
    per_sample = recipe.PerSampleDataset(split.images, split.targets, split.mean, split.std)
    for i in (0, 17, len(split) - 1):
        x, y = per_sample[i]
        bx, by = split[i]
        assert x.shape == bx.shape == (1, 28, 28) and y == by
        # Same maths in a different order ((x / 255 - mean) / std, per sample or in bulk).
        assert x.sub(bx).abs().max() < 1e-5


def test_memory_quick_run_reports_positive_figures(tmp_path):
    """--memory --quick: every variant's peak RSS is positive; ddptrain's shared rows counted."""
    result = memory.main(["--memory", "--quick", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "memory.json").read_text())
    assert saved == json.loads(json.dumps(result))
    mlp = saved["models"]["mlp"]
    assert list(mlp["variants"]) == list(memory.VARIANTS)
    assert mlp["grad_bytes"] == 4 * sum(p.numel() for p in memory.MODELS["mlp"][0]().parameters())
    for name, row in mlp["variants"].items():
        assert row["peak_rss_bytes"] > 0 and row["peak_with_shm_bytes"] > 0, name
        assert len(row["per_rank"]) == 2, name
    ours = mlp["variants"]["ddptrain"]
    # Shared memory is ddptrain's default on CPU; its rows hold at least the gradients.
    if ours["shm_mapped_bytes"]:
        assert ours["shm_mapped_bytes"] >= mlp["grad_bytes"]
    assert mlp["variants"]["torch_ddp"]["vs_torch_ddp_grad_copies"] == 0.0
    assert mlp["variants"]["torch_ddp"]["host_share_vs_torch_ddp_grad_copies"] == 0.0
    assert "host share" in memory.format_table(saved)


def test_host_share_counts_each_shared_file_once_per_host():
    """Shared rows: in full per rank for peak+shm, split among the ranks for the host share."""
    mib = 2**20
    # 300 MiB peak of which 96 MiB are touched shared pages; 128 MiB mapped by 2 ranks.
    f = memory.peak_figures(300 * mib, 96 * mib, 128 * mib, world_size=2)
    assert f["peak_with_shm_bytes"] == (300 - 96 + 128) * mib
    assert f["peak_host_share_bytes"] == (300 - 96 + 64) * mib
    private = memory.peak_figures(300 * mib, 0, 0, world_size=4)
    assert private["peak_with_shm_bytes"] == private["peak_host_share_bytes"] == 300 * mib


MAPS = """\
7f0000000000-7f0000400000 rw-s 00000000 00:1a 123  /dev/shm/ddptrain-abc-0 (deleted)
7f0000400000-7f0000401000 rw-s 00000000 00:1a 124  /dev/shm/ddptrain-abc-1 (deleted)
7f0000500000-7f0000600000 rw-s 00000000 00:1a 125  /dev/shm/other-file
7f0000600000-7f0000700000 rw-p 00000000 00:00 0
7ffd00000000-7ffd00021000 rw-p 00000000 00:00 0    [stack]
"""


def test_shm_bytes_come_from_ddptrain_mappings_only():
    """Only /dev/shm/ddptrain-* mappings are counted, each by its address range."""
    assert memory.shm_mapped_bytes(MAPS) == 0x400000 + 0x1000
    assert memory.status_bytes("VmHWM:\t  2048 kB\nRssShmem:\t 12 kB\n", "RssShmem") == 12 * 1024
    assert memory.status_bytes("VmHWM:\t  2048 kB\n", "RssShmem") == 0


def test_memory_of_the_zero_stages_holds_their_share(tmp_path):
    """With AdamW, DDP holds 16 bytes a parameter, ZeRO-1 8 + 8/ws, ZeRO-3 16/ws; peaks positive."""
    argv = ["--memory", "--quick", "--optimizer", "adamw", "--malloc", "return"]
    argv += ["--variants", "ddptrain,zero1,zero3", "--out", str(tmp_path)]
    mlp = memory.main(argv)["models"]["mlp"]
    params = mlp["grad_bytes"]
    held = {v: row["held_bytes"] for v, row in mlp["variants"].items()}
    # Beyond the shares: Adam's 4-byte step counters and up to 64 elements of alignment
    # per parameter and state (10 parameters, 4 bytes, 4 copies): at most 11 KiB.
    slack = 10 * 4 * (64 * 4 + 1)
    assert 0 <= held["ddptrain"] - 4 * params <= slack
    assert abs(held["zero1"] - (2 * params + 2 * params / 2)) <= slack
    assert abs(held["zero3"] - 4 * params / 2) <= slack
    assert all(row["training_peak_bytes"] > 0 for row in mlp["variants"].values())
