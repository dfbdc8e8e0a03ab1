"""The README's and the guide's examples run as written."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from support.child_env import child_env
from support.doc_blocks import python_block
from support.idx_files import write_split
from support.launch_cmds import DDPTRAIN_RUN

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 240


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    done = subprocess.run(
        args, cwd=cwd, env=child_env(), capture_output=True, text=True, timeout=TIMEOUT_S
    )
    assert done.returncode == 0, f"{args} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    return done


def _bash_blocks(doc: str) -> list[str]:
    return re.findall(r"```bash\n(.*?)```", (ROOT / doc).read_text(), flags=re.DOTALL)


def test_readme_and_guide_give_the_same_set_up_with_the_cpu_torch_command_written_out():
    """README and guide open set-up with one block, whose first line installs CPU-only torch."""
    # The CUDA path is left to PyTorch's selector page, which both link.
    readme = (ROOT / "README.md").read_text().split("## Set up", 1)[1]
    guide = (ROOT / "docs" / "guide.md").read_text().split("Set-up, as in the README:", 1)[1]
    blocks = [
        re.search(r"```bash\n(.*?)```", text, flags=re.DOTALL).group(1) for text in (readme, guide)
    ]
    assert blocks[0] == blocks[1]
    first = blocks[0].splitlines()[0]
    assert first.startswith("pip install torch --index-url https://download.pytorch.org/whl/cpu")
    for text in (readme, guide):
        assert "https://pytorch.org/get-started/locally/" in text.split("\n\n## ", 1)[0]


@pytest.mark.parametrize("doc", ["README.md", "docs/guide.md"])
def test_launch_commands_use_ddptrain_run(doc):
    """Every multi-process command in the doc's command blocks launches with ddptrain-run."""
    # Plain torchrun may be mentioned in the text, just not commanded.
    lines = [line.strip() for block in _bash_blocks(doc) for line in block.splitlines()]
    assert not [line for line in lines if re.search(r"(^|&& |\s)torchrun ", line)], doc
    assert any("ddptrain-run --standalone" in line for line in lines), doc


def test_readme_quick_start_runs_as_one_process_and_under_ddptrain_run(tmp_path):
    """README's train.py prints its world size and a finite loss, alone and at 2 ranks."""
    (tmp_path / "train.py").write_text(python_block("README.md", "ddptrain.DDP(LeNet()"))
    run = [*DDPTRAIN_RUN, "--standalone", "--nproc_per_node=2"]
    for world_size, launch in ((1, [sys.executable]), (2, run)):
        out = _run([*launch, "train.py"], tmp_path).stdout
        found = re.findall(r"^world_size=(\d+) loss=(\S+)$", out, flags=re.MULTILINE)
        assert len(found) == 1, out  # rank 0 only prints
        assert int(found[0][0]) == world_size
        assert math.isfinite(float(found[0][1]))


def test_guide_trainer_example_trains_checkpoints_and_resumes_when_finished(tmp_path):
    """The guide's train.py learns and checkpoints each epoch; a rerun resumes, only evaluates."""
    (tmp_path / "train.py").write_text(python_block("docs/guide.md", "class ToyTrainer(Trainer)"))
    # 1,800 training samples, global batch 64, 3 epochs, the last batch kept.
    steps = 3 * math.ceil(1_800 / 64)
    first = _run([sys.executable, "train.py"], tmp_path).stdout
    final = re.findall(rf"^step {steps}: (\{{.*\}})$", first, flags=re.MULTILINE)
    assert len(final) == 1, first
    accuracy = float(re.search(r"'eval_accuracy': ([0-9.]+)", final[0]).group(1))
    assert accuracy > 0.5, f"4 classes: chance is 0.25, got {accuracy}"
    ckpt = tmp_path / "runs" / "toy" / "ckpt"
    assert sorted(p.name for p in ckpt.glob("*.pt")) == [
        f"ckpt-{s:08d}.pt" for s in (steps // 3, 2 * steps // 3, steps)
    ]
    assert (tmp_path / "runs" / "toy" / "metrics.jsonl").stat().st_size > 0
    again = _run([sys.executable, "train.py"], tmp_path).stdout
    assert f"resumed at step {steps}" in again
    assert re.findall(rf"^step {steps}: (\{{.*\}})$", again, flags=re.MULTILINE) == final


def test_guide_spawn_example_returns_every_ranks_summary(tmp_path):
    """The guide's toy_job.py and spawn call train at 2 ranks and return both ranks' summaries."""
    (tmp_path / "train.py").write_text(python_block("docs/guide.md", "class ToyTrainer(Trainer)"))
    (tmp_path / "toy_job.py").write_text(python_block("docs/guide.md", "def run(epochs)"))
    call = python_block("docs/guide.md", "ddptrain.spawn(toy_job.run")
    # As the guide says: in a script, call spawn under `if __name__ == "__main__":`.
    body = "".join(f"    {line}\n" for line in call.splitlines())
    report = '    print("SUMMARIES", json.dumps(summaries))\n'
    script = f'import json\n\nif __name__ == "__main__":\n{body}{report}'
    (tmp_path / "notebook.py").write_text(script)
    out = _run([sys.executable, "notebook.py"], tmp_path).stdout
    summaries = json.loads(out.split("SUMMARIES ", 1)[1].splitlines()[0])
    assert [s["world_size"] for s in summaries] == [2, 2]
    assert summaries[0]["step"] == summaries[1]["step"] == 3 * math.ceil(1_800 / 64)
    assert summaries[0]["eval"] == summaries[1]["eval"]
    assert summaries[0]["eval"]["eval_accuracy"] > 0.5


@pytest.mark.slow
def test_guide_language_model_learns_bytes(tmp_path):
    """The guide's lm.py, trained on the json package, ends below 5 bits per byte (uniform is 8)."""
    (tmp_path / "lm.py").write_text(python_block("docs/guide.md", "class LMTrainer(Trainer)"))
    out = _run([sys.executable, "lm.py"], tmp_path).stdout
    found = re.findall(r"^validation: ([\d.]+) bits per byte$", out, flags=re.MULTILINE)
    assert len(found) == 1, out
    assert float(found[0]) < 5.0, out


def test_guide_loads_a_recipe_checkpoint_without_ddptrain(tmp_path):
    """The guide's snippet loads a recipe checkpoint into a plain LeNet built as it says."""
    raw = tmp_path / "data" / "MNIST" / "raw"
    write_split(raw, "train", 640, seed=1)
    write_split(raw, "t10k", 101, seed=2)
    recipe = [sys.executable, str(ROOT / "recipes" / "mnist.py"), "--data-dir", "data"]
    _run([*recipe, "--dry-run", "--no-progress-bar", "--checkpoint-dir", "ckpt"], tmp_path)
    saved = sorted((tmp_path / "ckpt").glob("ckpt-*.pt"))  # zero-padded: the last is newest
    assert saved, "the recipe saved no checkpoint"
    snippet = python_block("docs/guide.md", 'state["model"]')
    snippet = re.sub(r'"ckpt/ckpt-\d+\.pt"', repr(str(saved[-1])), snippet)
    scope: dict = {}
    exec(snippet, scope)  # load_state_dict is strict: a missing or mis-shaped key raises
    loaded = scope["model"].state_dict()
    assert loaded.keys() == scope["state"]["model"].keys()
    assert all(torch.equal(loaded[k], v) for k, v in scope["state"]["model"].items())
