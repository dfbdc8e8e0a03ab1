"""The MNIST recipe runs end to end under ddptrain-run (torchrun's engine, as the README runs
it), torchrun itself, and as a plain script (on small IDX data)."""

from __future__ import annotations

import dataclasses
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ddptrain import cli
from ddptrain.data import datasets
from ddptrain.flags import in_flags
from ddptrain.train.config import ConfigError, TrainerConfig
from support.child_env import child_env
from support.idx_files import (
    FASHION_FIRST_LABELS,
    MNIST_ROOT,
    closed_port_url,
    serve_folder,
    write_split,
)
from support.launch_cmds import LAUNCHERS

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "mnist.py"
REAL_RAW = MNIST_ROOT / "MNIST/raw"


@pytest.fixture
def data_dir(tmp_path) -> Path:
    folder = tmp_path / "data" / "MNIST" / "raw"
    write_split(folder, "train", 640, seed=1)
    write_split(folder, "t10k", 101, seed=2)
    return tmp_path / "data"


def _run(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        args, cwd=tmp_path, env=child_env(), capture_output=True, text=True, timeout=240
    )


def _launch(nproc: int, launcher: str = "ddptrain-run") -> list[str]:
    return [*LAUNCHERS[launcher], "--standalone", f"--nproc_per_node={nproc}"]


@pytest.mark.skipif(not REAL_RAW.is_dir(), reason=f"shared MNIST not found at {REAL_RAW}")
def test_dry_run_at_world_size_2_downloads_the_test_split_then_trains_and_checkpoints(tmp_path):
    """At 2 ranks the recipe fetches the missing test split from a local mirror, trains, saves."""
    data_dir = tmp_path / "data"
    write_split(data_dir / "MNIST" / "raw", "train", 640, seed=1)
    ckpt_dir = tmp_path / "ckpt"
    with serve_folder(REAL_RAW) as mirror:
        result = _run(
            _launch(2)
            + [
                str(RECIPE),
                "--data-dir",
                str(data_dir),
                "--mirror",
                mirror,
                "--dry-run",
                "--no-progress-bar",
                "--checkpoint-dir",
                str(ckpt_dir),
                "--log-dir",
                str(tmp_path / "logs"),
            ],
            tmp_path,
        )
    assert result.returncode == 0, result.stdout + result.stderr
    final = re.search(r"^FINAL .*test_accuracy=([\d.]+).*world_size=2$", result.stdout, re.M)
    assert final, result.stdout
    assert "steps=5" in final.group(0)
    assert "world_size=2 backend=gloo" in result.stdout
    raw = data_dir / "MNIST" / "raw"
    assert result.stdout.splitlines()[0] == f"data: MNIST train 640 / test 10000 from {raw}"
    assert result.stdout.count("data: ") == 1, result.stdout  # rank 0 alone
    assert sorted(p.name for p in (data_dir / "MNIST/raw").iterdir()) == [
        "t10k-images-idx3-ubyte.gz",
        "t10k-labels-idx1-ubyte.gz",
        "train-images-idx3-ubyte.gz",
        "train-labels-idx1-ubyte.gz",
    ]
    assert (ckpt_dir / "ckpt-00000005.pt").is_file()
    assert (tmp_path / "logs" / "metrics.jsonl").read_text().count("\n") >= 2


def test_plain_python_run_and_target_acc_exit_code(tmp_path, data_dir):
    """python recipes/mnist.py works as world size 1; --target-acc above reach exits 1."""
    result = _run(
        [
            sys.executable,
            str(RECIPE),
            "--data-dir",
            str(data_dir),
            "--dry-run",
            "--no-progress-bar",
            "--target-acc",
            "1.01",
        ],
        tmp_path,
    )
    assert result.returncode == 1, result.stdout + result.stderr
    raw = data_dir / "MNIST" / "raw"
    assert result.stdout.splitlines()[0] == f"data: MNIST train 640 / test 101 from {raw}"
    assert "world_size=1" in result.stdout
    assert "below --target-acc 1.01" in result.stdout


@pytest.mark.parametrize(
    "launcher", ["ddptrain-run", pytest.param("torchrun", marks=pytest.mark.slow)]
)
def test_offline_without_data_is_one_error_line_from_two_ranks(tmp_path, launcher):
    """No data and no mirror at 2 ranks: one `error:` line naming the fix, exit status 1."""
    data_dir = tmp_path / "none"
    result = _run(
        _launch(2, launcher)
        + [str(RECIPE), "--data-dir", str(data_dir), "--mirror", closed_port_url(), "--dry-run"],
        tmp_path,
    )
    assert result.returncode == 1
    lines = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: could not download train-images-idx3-ubyte.gz")
    assert f"in {data_dir / 'MNIST/raw'}/" in lines[0] and "--dataset fashion-mnist" in lines[0]
    assert f"{launcher} --standalone --nproc_per_node=2 " in lines[0]
    assert "[rank0]" not in result.stderr and "[rank1]" not in result.stderr, result.stderr
    assert list((data_dir / "MNIST/raw").iterdir()) == []
    if launcher == "ddptrain-run":
        assert result.stderr.splitlines() == lines
    else:
        assert "ChildFailedError" in result.stderr


def test_a_bad_flag_is_one_line_and_exit_status_2(tmp_path):
    """python recipes/mnist.py --lr -1 prints exactly one line on stderr and exits 2."""
    result = _run([sys.executable, str(RECIPE), "--lr", "-1"], tmp_path)
    assert result.returncode == 2
    assert result.stderr == "error: argument --lr: must be > 0, got -1 (see mnist.py --help)\n"


def _recipe_module():
    spec = importlib.util.spec_from_file_location("mnist_recipe", RECIPE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# @record enables faulthandler on stderr, which pytest has swapped for an object without fileno.
@pytest.mark.filterwarnings("ignore:Unable to enable fault handler")
def test_the_system_fashion_mnist_stands_in_only_when_no_data_dir_is_given(
    tmp_path, monkeypatch, capsys
):
    """The system Fashion-MNIST copy is read only without --data-dir, and the first line says so."""
    system = tmp_path / "system"
    write_split(system, "train", 64, first_labels=FASHION_FIRST_LABELS["train"])
    write_split(system, "t10k", 20, first_labels=FASHION_FIRST_LABELS["t10k"])
    spec = dataclasses.replace(datasets._FASHION_MNIST, fallback_dirs=(system,))
    monkeypatch.setattr(datasets, "_FASHION_MNIST", spec)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", cli.DEBUG_ENV):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.chdir(tmp_path)  # no data/ here
    main = _recipe_module().main
    flags = [
        "--dataset",
        "fashion-mnist",
        "--dry-run",
        "--no-progress-bar",
        "--global-batch-size",
        "16",
    ]

    assert cli.run_main(main, flags) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == f"data: Fashion-MNIST train 64 / test 20 from {system}"

    (tmp_path / "mine").mkdir()
    assert cli.run_main(main, [*flags, "--data-dir", "mine"]) == 1
    out, err = capsys.readouterr()
    assert "data: " not in out
    assert err.startswith("error: --data-dir mine is empty; point --data-dir at"), err


def test_help_names_a_default_for_every_flag():
    """Each flag in `recipes/mnist.py --help` has a help line ending in its default."""
    text = _recipe_module().build_parser().format_help()
    entries = re.split(r"\n(?=  -)", text.split("\noptions:\n", 1)[1])
    flags = [entry.split()[0].rstrip(",") for entry in entries]
    assert len(flags) > 25 and "--epochs" in flags and "--keep-last" in flags, flags
    for flag, entry in zip(flags, entries, strict=True):
        if flag != "-h":
            assert "(default: " in " ".join(entry.split()), entry


def test_checkpoint_flags_reach_the_config():
    """--checkpoint-every-steps and --keep-last set TrainerConfig's fields, else its defaults."""
    recipe = _recipe_module()
    base = ["--checkpoint-dir", "ckpt"]
    cfg = recipe.build_config(
        recipe.parse_args([*base, "--checkpoint-every-steps", "7", "--keep-last", "2"])
    )
    assert (cfg.checkpoint_every_steps, cfg.keep_last) == (7, 2)
    cfg = recipe.build_config(recipe.parse_args(base))
    assert (cfg.checkpoint_every_steps, cfg.keep_last) == (None, 3)
    with pytest.raises(cli.UsageError, match="did you mean --keep-last"):
        recipe.parse_args([*base, "--keep", "2"])


def test_preemption_flags_reach_the_config():
    """--checkpoint-every-minutes and --preempt-signals set their fields; bad ones name the flag."""
    recipe = _recipe_module()
    base = ["--checkpoint-dir", "ckpt"]
    args = [*base, "--checkpoint-every-minutes", "0.5", "--preempt-signals", "TERM,SIGUSR2"]
    cfg = recipe.build_config(recipe.parse_args(args))
    assert (cfg.checkpoint_every_minutes, cfg.preempt_signals) == (0.5, ("SIGTERM", "SIGUSR2"))
    cfg = recipe.build_config(recipe.parse_args([*base, "--preempt-signals", "none"]))
    assert (cfg.checkpoint_every_minutes, cfg.preempt_signals) == (None, ())
    assert recipe.build_config(recipe.parse_args(base)).preempt_signals == (
        "SIGTERM",
        "SIGINT",
        "SIGUSR1",
    )
    with pytest.raises(ConfigError, match="unknown signal 'SIGFOO'"):
        recipe.build_config(recipe.parse_args([*base, "--preempt-signals", "SIGFOO"]))
    with pytest.raises(ConfigError) as info:
        recipe.build_config(recipe.parse_args(["--checkpoint-every-minutes", "5"]))
    assert in_flags(str(info.value), TrainerConfig) == (
        "--checkpoint-every-minutes 5.0 saves into --checkpoint-dir; set --checkpoint-dir too"
    )


@pytest.mark.slow
def test_resume_auto_at_world_size_2_sets_a_truncated_checkpoint_aside(tmp_path, data_dir):
    """--resume auto at 2 ranks moves a truncated checkpoint to invalid/ and resumes at step 2."""
    ckpt_dir = tmp_path / "ckpt"
    flags = [
        str(RECIPE),
        "--data-dir",
        str(data_dir),
        "--no-progress-bar",
        "--global-batch-size",
        "64",
        "--checkpoint-dir",
        str(ckpt_dir),
        "--checkpoint-every-steps",
        "2",
        "--keep-last",
        "5",
    ]
    first = _run([sys.executable, *flags, "--max-steps", "4"], tmp_path)
    assert first.returncode == 0, first.stdout + first.stderr
    newest = ckpt_dir / "ckpt-00000004.pt"
    newest.write_bytes(newest.read_bytes()[:1000])

    result = _run([*_launch(2), *flags, "--max-steps", "6", "--resume", "auto"], tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    notes = [line for line in result.stdout.splitlines() if line.startswith("resume='auto'")]
    assert len(notes) == 1, result.stdout
    assert notes[0].startswith(f"resume='auto': {newest} is 1000 bytes but ckpt-00000004.json")
    assert notes[0].endswith(f"moved it and its sidecar to {ckpt_dir / 'invalid'}/")
    assert f"resuming from {ckpt_dir / 'ckpt-00000002.pt'} (step 2)" in result.stdout
    assert len((ckpt_dir / "invalid" / newest.name).read_bytes()) == 1000
    assert sorted(p.name for p in ckpt_dir.glob("*.pt")) == [
        "ckpt-00000002.pt",
        "ckpt-00000004.pt",
        "ckpt-00000006.pt",
    ]
