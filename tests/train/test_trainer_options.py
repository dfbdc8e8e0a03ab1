"""Trainer options checked end to end: accumulation, clipping, bf16, eval cadence, loader
workers with resume, comm hook from the config, best checkpoint, metrics.jsonl, evaluate().

One spawned world of 3 ranks runs every case (worlds.run_cases), each in its own folder.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import ddptrain
from ddptrain.cpu.ring import Ring
from ddptrain.train import build
from ddptrain.train import checkpoint as ckpt
from ddptrain.train.config import TrainerConfig
from ddptrain.train.evaluation import evaluate
from support import worlds
from support.toy_models import N_TRAIN, CrashAt, ToyTrainer

# A spawned world runs many cases, so its first test waits for all of them: generous bounds
# (a loaded 2-core machine runs it several times slower) that a hang still reaches.
WORLD_TIMEOUT_S = 540
pytestmark = pytest.mark.timeout(WORLD_TIMEOUT_S + 60)

WORLD_SIZE = 3
STEPS = 2 * N_TRAIN // 12  # two epochs of global batch 12
# Two runs of the smooth (tanh) ToyTrainer that sum in another order (accumulation, another
# transport): ulp-sized gradient differences carried over 16 momentum steps (gain <= 10) at lr
# 0.1. Measured on a 2-core AMD EPYC: 6.0e-8 (accumulation 2 vs 1, ring vs default at ws 3);
# a missing micro-batch or an unscaled accumulation is off by >= 1e-2.
SMOOTH_ATOL = 1e-5
# bf16 autocast vs fp32: matmul inputs rounded to 8 bits (relative 2^-8 = 4e-3) per step, over
# 16 steps x lr 0.1 x momentum gain 10 on gradients <= ~0.3: about 2e-2 at worst. Measured on a
# 2-core AMD EPYC: 1.2e-3. The lower bound (> 0) shows autocast took effect.
BF16_ATOL = 2e-2


def _config(root: str, name: str, **overrides) -> TrainerConfig:
    base = TrainerConfig(
        global_batch_size=12,
        epochs=2,
        log_every_steps=2,
        log_dir=f"{root}/{name}/logs",
        progress_bar=False,
    )
    return replace(base, **overrides)


def _params(trainer: ToyTrainer) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in trainer.model.module.parameters()])


def _records(root: str, name: str) -> list[dict]:
    return [json.loads(line) for line in open(f"{root}/{name}/logs/metrics.jsonl")]


def _fit(config: TrainerConfig, **kwargs) -> tuple[dict, torch.Tensor, ToyTrainer]:
    trainer = ToyTrainer(config, **kwargs)
    summary = trainer.fit()
    return summary, _params(trainer), trainer


def _case_smooth_variants(info, root: str) -> dict:
    """The smooth reference run and its variants: accumulation, bf16, the ring hook."""
    summary, reference, _ = _fit(_config(root, "reference"), smooth=True)
    _, accum, _ = _fit(_config(root, "accum", grad_accum_steps=2), smooth=True)
    bf16_summary, bf16, _ = _fit(_config(root, "bf16", precision="bf16"), smooth=True)
    _, ring, ring_trainer = _fit(_config(root, "ring", comm_hook="ring"), smooth=True)
    return {
        "steps": summary["step"],
        "reference": reference,
        "accum": accum,
        "bf16": bf16,
        "bf16_summary": bf16_summary,
        "reference_summary": summary,
        "ring": ring,
        "ring_hook": type(ring_trainer.model.comm_hook[0]).__name__,
        # Rank 0 writes the log; the others could read it before it is closed.
        "bf16_losses": [r["loss"] for r in _records(root, "bf16") if "loss" in r]
        if info.is_main
        else None,
    }


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Every case of this module from one spawned world of WORLD_SIZE ranks."""
    root = str(tmp_path_factory.mktemp("options"))
    results = ddptrain.spawn(_run_cases, WORLD_SIZE, root, timeout_s=WORLD_TIMEOUT_S)
    return root, results


def test_grad_accum_equals_one_big_batch(world):
    """grad_accum_steps=2 trains like one batch of the same global size (smooth model, 1e-5)."""
    for r in worlds.outcome(world[1], "smooth"):
        diff = (r["accum"] - r["reference"]).abs().max().item()
        print(f"accumulation 2 vs 1 at ws {WORLD_SIZE}: max|diff| = {diff:.3g}")
        assert r["steps"] == STEPS
        assert diff <= SMOOTH_ATOL


def test_bf16_autocast_on_cpu_trains_close_to_fp32(world):
    """precision='bf16' on CPU changes the arithmetic (weights differ) but trains like fp32."""
    results = worlds.outcome(world[1], "smooth")
    losses = results[0]["bf16_losses"]
    assert losses[-1] < 0.7 * losses[0], losses
    for r in results:
        diff = (r["bf16"] - r["reference"]).abs().max().item()
        print(f"bf16 vs fp32: max|diff| = {diff:.3g}")
        assert 0 < diff <= BF16_ATOL
        bf16_acc = r["bf16_summary"]["eval"]["eval_accuracy"]
        assert abs(bf16_acc - r["reference_summary"]["eval"]["eval_accuracy"]) <= 0.2


def test_comm_hook_from_config_reaches_the_wrapper(world):
    """comm_hook='ring' in TrainerConfig puts the ring in the wrapper; it trains like default."""
    for r in worlds.outcome(world[1], "smooth"):
        assert r["ring_hook"] == Ring.__name__
        diff = (r["ring"] - r["reference"]).abs().max().item()
        print(f"ring vs default hook at ws {WORLD_SIZE}: max|diff| = {diff:.3g}")
        assert diff <= SMOOTH_ATOL


class _PlainSGD(ToyTrainer):
    """Plain SGD (no momentum, no decay): one step moves the weights by exactly lr * grad."""

    LR = 0.1

    def configure_optimizers(self, model):
        return torch.optim.SGD(model.parameters(), lr=self.LR)


def _case_clip(info, root: str) -> dict:
    torch.manual_seed(0)
    initial = torch.cat(
        [p.reshape(-1) for p in _PlainSGD(_config(root, "x")).build_model().parameters()]
    )
    out = {}
    for name, clip in (("clipped", 1e-3), ("free", None)):
        trainer = _PlainSGD(_config(root, name, max_steps=1, grad_clip_norm=clip))
        trainer.fit()
        out[name] = ((_params(trainer) - initial) / _PlainSGD.LR).detach()
    return out


def test_grad_clip_norm_bounds_the_update(world):
    """grad_clip_norm=1e-3 rescales the averaged gradient to norm 1e-3, keeping its direction."""
    for r in worlds.outcome(world[1], "clip"):
        clipped, free = r["clipped"], r["free"]
        assert free.norm() > 10 * 1e-3
        # clip_grad_norm_ scales by max_norm / (norm + 1e-6); float32 steps round at ~1e-7.
        torch.testing.assert_close(clipped.norm(), torch.tensor(1e-3), rtol=1e-3, atol=0)
        torch.testing.assert_close(clipped, free * (1e-3 / free.norm()), rtol=0, atol=1e-6)


def _case_eval_every(info, root: str) -> list | None:
    ToyTrainer(_config(root, "eval_every", eval_every_steps=3)).fit()
    return _records(root, "eval_every") if info.is_main else None


def test_eval_every_steps_sets_the_eval_cadence(world):
    """eval_every_steps=3 evaluates at steps 3, 6, ... and once more at the last step."""
    records = worlds.outcome(world[1], "eval_every")[0]
    eval_steps = [r["step"] for r in records if "eval_loss" in r]
    assert eval_steps == [*range(3, STEPS, 3), STEPS]


def _case_workers_resume(info, root: str) -> dict:
    def config(name, workers, **kw):
        return _config(
            root,
            name,
            num_workers=workers,
            checkpoint_dir=f"{root}/{name}/ckpt",
            checkpoint_every_steps=5,
            resume="auto",
            **kw,
        )

    _, no_workers, _ = _fit(config("w0", 0), dropout=0.3)
    _, straight, _ = _fit(config("w2", 2), dropout=0.3)
    crashed = None
    try:
        _fit(config("w2_resumed", 2), dropout=0.3, fault={"kind": "raise", "step": 13})
    except CrashAt as e:
        crashed = str(e)
    summary, resumed, _ = _fit(config("w2_resumed", 2), dropout=0.3)
    return {
        "no_workers": no_workers,
        "straight": straight,
        "resumed": resumed,
        "crashed": crashed,
        "step": summary["step"],
    }


def test_num_workers_resume_is_bitwise_equal(world):
    """With 2 loader workers and dropout, a crash+resume run equals the straight run bitwise."""
    for r in worlds.outcome(world[1], "workers_resume"):
        assert r["crashed"] and r["step"] == STEPS
        assert torch.equal(r["resumed"], r["straight"])
        # Workers only move loading elsewhere: the same batches as num_workers=0.
        assert torch.equal(r["straight"], r["no_workers"])


def _case_best(info, root: str) -> dict | None:
    cfg = _config(
        root,
        "best",
        checkpoint_dir=f"{root}/best/ckpt",
        checkpoint_every_steps=2,
        eval_every_steps=2,
        keep_last=1,
        best_metric="eval_loss",
        best_mode="min",
    )
    ToyTrainer(cfg, dropout=0.3).fit()
    if not info.is_main:
        return None
    best = ckpt.best_checkpoint(cfg.checkpoint_dir)
    pointer = json.loads((Path(cfg.checkpoint_dir) / ckpt.BEST_POINTER).read_text())
    return {
        "best": best.name if best else None,
        "pointer": pointer,
        "kept": [p.name for p in ckpt.list_checkpoints(cfg.checkpoint_dir)],
        "records": _records(root, "best"),
    }


def test_best_checkpoint_points_at_the_lowest_eval_loss(world):
    """best_metric='eval_loss' (min) records the saved step with the lowest logged eval_loss."""
    r = worlds.outcome(world[1], "best")[0]
    evals = {rec["step"]: rec["eval_loss"] for rec in r["records"] if "eval_loss" in rec}
    assert sorted(evals) == [*range(2, STEPS + 1, 2)]
    best_step = min(evals, key=lambda s: (evals[s], s))
    assert r["pointer"]["step"] == best_step and r["pointer"]["value"] == evals[best_step]
    assert r["best"] == ckpt.checkpoint_name(best_step)
    assert ckpt.checkpoint_name(STEPS) in r["kept"]


class _Recording(ToyTrainer):
    """Keeps every training step's local loss, to check what fit() logs."""

    def __init__(self, config):
        super().__init__(config)
        self.losses: list[float] = []

    def training_step(self, model, batch):
        loss = super().training_step(model, batch)
        self.losses.append(loss.item())
        return loss


def _case_metrics(info, root: str) -> dict:
    ckpt_dir = f"{root}/metrics/ckpt"
    trainer = _Recording(_config(root, "metrics", log_every_steps=3, checkpoint_dir=ckpt_dir))
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        summary = trainer.fit()
    losses = [None] * info.world_size
    dist.all_gather_object(losses, trainer.losses)
    if not info.is_main:
        return {"losses": losses, "summary": summary}
    sidecars = [json.loads(p.read_text()) for p in sorted(Path(ckpt_dir).glob("ckpt-*.json"))]
    return {
        "losses": losses,
        "records": _records(root, "metrics"),
        "summary": summary,
        "printed": printed.getvalue().splitlines(),
        "sidecars": [(s["step"], s["epoch"]) for s in sidecars],
    }


def test_metrics_jsonl_holds_window_mean_losses_lr_and_the_eval(world):
    """Each logged loss is the mean over ranks and window steps; lr follows the schedule."""
    r = worlds.outcome(world[1], "metrics")[0]
    per_step = torch.tensor(r["losses"], dtype=torch.float64).mean(0)  # mean over ranks
    train = [rec for rec in r["records"] if "loss" in rec]
    assert [rec["step"] for rec in train] == [*range(3, STEPS, 3), STEPS]
    start = 0
    for rec in train:
        expected = per_step[start : rec["step"]].mean().item()
        # fit() sums the window in float32 before the float64 mean: a few float32 ulps.
        assert rec["loss"] == pytest.approx(expected, rel=1e-6), rec
        assert rec["lr"] == pytest.approx(0.1 * 0.7 ** (rec["step"] // 4), rel=1e-12)
        assert rec["epoch"] == (rec["step"] - 1) // (N_TRAIN // 12) + 1
        assert rec["samples_per_s"] > 0
        start = rec["step"]
    times = [rec["time_s"] for rec in train]
    assert times == sorted(times)
    evals = [rec for rec in r["records"] if "eval_loss" in rec]
    assert [rec["step"] for rec in evals] == [STEPS // 2, STEPS]  # at each epoch's end
    assert {k: evals[-1][k] for k in r["summary"]["eval"]} == r["summary"]["eval"]
    assert r["summary"]["train_loss"] == train[-1]["loss"]


def test_one_epoch_numbering_in_records_lines_checkpoints_and_summary(world):
    """Epochs count from 1 alike in metrics.jsonl, the eval line, the sidecars and the summary."""
    r = worlds.outcome(world[1], "metrics")[0]
    half = STEPS // 2
    evals = [(rec["step"], rec["epoch"]) for rec in r["records"] if "eval_loss" in rec]
    assert evals == [(half, 1), (STEPS, 2)]
    assert r["sidecars"] == [(half, 1), (STEPS, 2)]
    lines = [line for line in r["printed"] if line.startswith("step ")]
    assert [line.split(":")[0] for line in lines] == [
        f"step {half} epoch 1/2",
        f"step {STEPS} epoch 2/2",
    ]
    assert r["summary"]["epoch"] == 2


def _validation_step(module, batch):
    x, y = batch
    out = module(x)
    return {
        "loss": F.cross_entropy(out, y, reduction="sum"),
        "accuracy": (out.argmax(1) == y).sum(),
    }


def _case_evaluate(info, root: str) -> dict:
    torch.manual_seed(0)
    module = torch.nn.Linear(8, 3)  # same weights on every rank (same seed)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(10, 8, generator=g), torch.randint(0, 3, (10,), generator=g)
    out = {}
    for n in (10, 2):  # 10 over 3 ranks: 4+3+3; 2 over 3 ranks: rank 2's shard is empty
        rng_before = torch.get_rng_state()
        got = evaluate(
            module,
            TensorDataset(x[:n], y[:n]),
            _validation_step,
            batch_size=2,
            device=torch.device("cpu"),
        )
        rng_kept = torch.equal(rng_before, torch.get_rng_state())
        with torch.no_grad():
            one = _validation_step(module, (x[:n], y[:n]))
        out[n] = {
            "got": got,
            "one": {f"eval_{k}": v.item() / n for k, v in one.items()},
            "rng_kept": rng_kept,
        }
    return out


def test_evaluate_equals_one_process_on_the_whole_set(world):
    """evaluate() at 3 ranks equals one process on the whole set, even with an empty shard."""
    # The global RNG is left alone: training's dropout masks must not depend on evaluating.
    for r in worlds.outcome(world[1], "evaluate"):
        for n, d in r.items():
            assert d["rng_kept"], "evaluate() drew from the global torch RNG"
            assert d["got"]["eval_samples"] == n
            assert d["got"]["eval_accuracy"] == d["one"]["eval_accuracy"]
            # Per-batch float32 sums vs one float32 sum over the set: a few ulps apart.
            assert d["got"]["eval_loss"] == pytest.approx(d["one"]["eval_loss"], rel=1e-6)


CASES = {
    "smooth": _case_smooth_variants,
    "clip": _case_clip,
    "eval_every": _case_eval_every,
    "workers_resume": _case_workers_resume,
    "best": _case_best,
    "metrics": _case_metrics,
    "evaluate": _case_evaluate,
}


def _run_cases(root: str) -> dict:
    return worlds.run_cases(
        {k: functools.partial(f, root=root) for k, f in CASES.items()}, list(CASES)
    )


def test_loader_workers_are_not_forked_from_the_rank():
    """The Trainer's loader workers start from a clean process, not a fork of a threaded rank."""
    cfg = TrainerConfig(global_batch_size=4, num_workers=2)
    info = ddptrain.DistInfo(0, 0, 1, torch.device("cpu"), "gloo")
    data = TensorDataset(torch.arange(8.0))
    sampler = build.sampler(cfg, len(data))
    loader = build.loader(cfg, info, sampler, data)
    # A fork while a communication or heartbeat thread holds an interpreter lock deadlocks
    # the child at its start: the hang this guards against.
    assert loader.multiprocessing_context.get_start_method() in ("forkserver", "spawn")
    assert [b[0].tolist() for b in loader] == [
        b[0].tolist() for b in build.loader(replace(cfg, num_workers=0), info, sampler, data)
    ]
