"""A GPT on the Trainer at world size 2: activation checkpointing gives the gradients of the
plain backward (DDP wrapper with its Linear slots, ZeRO-3), clipping is bitwise alike at every
ZeRO stage, warmup + cosine steers ZeRO-1, a crashed run resumes exactly, and (slow)
compile=True trains like eager.

One spawned world runs every case (worlds.run_cases), each in its own folder.
"""

from __future__ import annotations

import functools
from dataclasses import replace
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

import ddptrain
from ddptrain.cpu.linear_slots import slot_params
from ddptrain.models import GPT
from ddptrain.train import gradients
from ddptrain.train.compute import checkpoint_blocks
from ddptrain.train.config import TrainerConfig
from ddptrain.train.optimizers import warmup_cosine_factor
from support import worlds
from support.gpt_trainer import BLOCK_SIZE, TinyGPTTrainer
from support.toy_models import CrashAt, flat_params

WORLD_TIMEOUT_S = 540
pytestmark = pytest.mark.timeout(WORLD_TIMEOUT_S + 60)
WORLD_SIZE = 2
STEPS = 8
# Wide enough that the MLP's first weight (256 x 1024 float32, 1 MiB) takes the DDP wrapper's
# Linear-slot path on CPU, which steps aside under checkpointing's saved-tensor hooks.
SLOT_WIDTH = 256
# compile=True against eager after STEPS AdamW steps: inductor's fused kernels round
# differently (float32 ulps per op), and AdamW's normalised update turns a relative rounding
# difference in a near-zero gradient into up to lr (3e-3) of movement per step. Measured on a
# 2-core AMD EPYC: 5.5e-6; the weights move by ~2e-2 in these steps, so a missed gradient
# or a skipped step is far outside.
COMPILE_ATOL = 1e-3
# Below the GPT's gradient norm at every one of the STEPS steps, so that every step clips.
CLIP = 0.05


def _config(root: str, name: str, **overrides) -> TrainerConfig:
    base = TrainerConfig(
        global_batch_size=8,
        max_steps=STEPS,
        log_every_steps=STEPS,
        eval_batch_size=16,
        progress_bar=False,
        heartbeat_timeout_s=None,
    )
    return replace(base, **overrides, log_dir=f"{root}/{name}/logs")


def _fit(config: TrainerConfig, **kwargs) -> tuple[dict, torch.Tensor, TinyGPTTrainer]:
    """(summary, whole parameters, trainer); the group outlives fit() so that a sharded
    model's parameters can be gathered."""
    trainer = TinyGPTTrainer(config, **kwargs)
    summary = trainer.fit()
    model = trainer.model
    if isinstance(model, ddptrain.FSDP):
        with model.summon_full_params():
            return summary, flat_params(model.module), trainer
    return summary, flat_params(model.module), trainer


def _grads(module: torch.nn.Module, stage: int, checkpointed: bool, rank: int) -> torch.Tensor:
    """One forward and backward at world size 2 (dropout on): this rank's gradients, the
    whole ones under the DDP wrapper, its shards' under ZeRO-3."""
    if checkpointed:
        checkpoint_blocks(module.blocks)
    if stage == 0:
        model = ddptrain.DDP(module)
    else:
        model = ddptrain.FSDP(module, units=list(module.blocks))
    g = torch.Generator().manual_seed(rank)
    x = torch.randint(0, 256, (4, BLOCK_SIZE), generator=g)
    torch.manual_seed(100 + rank)  # the dropout masks: the same draws in both runs
    logits = model(x)
    F.cross_entropy(logits.reshape(-1, 256), x.roll(-1, 1).reshape(-1)).backward()
    grads = [p.grad.reshape(-1) for p in model.parameters() if p.grad is not None]
    return torch.cat(grads).clone()


def _case_checkpointing(info) -> dict:
    out = {}
    for stage in (0, 3):
        for checkpointed in (False, True):
            torch.manual_seed(0)
            module = GPT(n_layer=2, n_head=2, n_embd=SLOT_WIDTH, block_size=BLOCK_SIZE, dropout=0.1)
            slots = len(slot_params(list(module.modules())))
            out[stage, checkpointed] = (_grads(module, stage, checkpointed, info.rank), slots)
    return out


def test_activation_checkpointing_gives_the_same_gradients_under_ddp_and_zero3(world):
    """Checkpointed blocks give bitwise the plain backward's gradients under DDP and ZeRO-3."""
    # Under DDP large Linear layers otherwise compute into their bucket slots; under ZeRO-3
    # the blocks are units, gathered again for the recomputation.
    for r in worlds.outcome(world(WORLD_SIZE), "checkpointing"):
        for stage in (0, 3):
            (plain, slots), (checkpointed, _) = r[stage, False], r[stage, True]
            assert slots > 0, "no Linear layer is large enough for the slot path"
            assert plain.abs().sum() > 0
            assert torch.equal(plain, checkpointed), stage


def _case_checkpointing_trainer(info, root: str) -> dict:
    out = {}
    for stage in (0, 3):
        for ckpt in (False, True):
            cfg = _config(root, f"ac{stage}{ckpt}", zero_stage=stage, activation_checkpointing=ckpt)
            out[stage, ckpt] = _fit(cfg, dropout=0.1)[1]
    return out


def test_activation_checkpointing_trains_bitwise_like_without_under_ddp_and_zero3(world):
    """activation_checkpointing=True trains 8 AdamW steps bitwise as without, at stages 0 and 3."""
    for r in worlds.outcome(world(WORLD_SIZE), "checkpointing_trainer"):
        for stage in (0, 3):
            assert torch.equal(r[stage, False], r[stage, True]), stage
        assert torch.equal(r[0, False], r[3, False])


def _case_clip(info, root: str) -> dict:
    out = {}
    measure = gradients.grad_norm
    for stage in (0, 1, 2, 3):
        norms = []

        def recording(model, max_norm, norms=norms):
            norm = measure(model, max_norm)
            norms.append(norm.clone())
            return norm

        cfg = _config(root, f"clip{stage}", zero_stage=stage, grad_clip_norm=CLIP)
        with mock.patch.object(gradients, "grad_norm", recording):
            out[stage] = (_fit(cfg)[1], torch.stack(norms))
    out["free"] = _fit(_config(root, "free"))[1]
    return out


def test_clipping_a_gpt_uses_the_same_global_norm_at_every_zero_stage(world):
    """Each step's global norm has the same bits at ZeRO stages 0-3; clipped runs end bitwise."""
    for r in worlds.outcome(world(WORLD_SIZE), "clip"):
        params, norms = r[0]
        assert norms.shape == (STEPS,) and bool((norms > CLIP).all())
        for stage in (1, 2, 3):
            assert torch.equal(norms, r[stage][1]), stage
            assert torch.equal(params, r[stage][0]), stage
        assert not torch.equal(params, r["free"])


class _LrTrainer(TinyGPTTrainer):
    """Records the lr of every group of the optimizer the Trainer steps, after each step."""

    def training_step(self, model, batch):
        self.lrs = getattr(self, "lrs", [])
        self.lrs.append([g["lr"] for g in self.optimizer.param_groups])
        return super().training_step(model, batch)


def _case_schedule(info, root: str) -> dict:
    out = {}
    for stage in (0, 1):
        trainer = _LrTrainer(_config(root, f"lr{stage}", zero_stage=stage))
        trainer.fit()
        out[stage] = {
            "lrs": trainer.lrs,
            "params": flat_params(trainer.model.module),
            "optimizer": type(trainer.optimizer).__name__,
        }
    return out


def test_warmup_cosine_sets_the_lr_of_every_group_under_zero1(world):
    """warmup_cosine sets both ZeRO-1 groups' lr every step; ZeRO-1 ends bitwise as stage 0."""
    for r in worlds.outcome(world(WORLD_SIZE), "schedule"):
        assert r[1]["optimizer"] == "ZeroRedundancyOptimizer"
        expected = [
            3e-3 * warmup_cosine_factor(s, warmup_steps=3, total_steps=STEPS, min_lr_ratio=0.1)
            for s in range(STEPS)
        ]
        for stage in (0, 1):
            assert [len(lrs) for lrs in r[stage]["lrs"]] == [2] * STEPS
            for lrs, want in zip(r[stage]["lrs"], expected, strict=True):
                assert lrs == pytest.approx([want, want], rel=1e-12)
        assert torch.equal(r[0]["params"], r[1]["params"])


def _case_resume(info, root: str) -> dict:
    out = {}
    for stage in (0, 3):

        def config(name, stage=stage):
            return _config(
                root,
                name,
                zero_stage=stage,
                activation_checkpointing=True,
                checkpoint_dir=f"{root}/{name}/ckpt",
                checkpoint_every_steps=3,
                resume="auto",
            )

        straight = _fit(config(f"straight{stage}"), dropout=0.1)[1]
        crashed = None
        try:
            _fit(config(f"resumed{stage}"), dropout=0.1, crash_at_step=5)
        except CrashAt as e:
            crashed = str(e)
        summary, resumed, _ = _fit(config(f"resumed{stage}"), dropout=0.1)
        out[stage] = (straight, resumed, crashed, summary["step"])
    return out


def test_a_crashed_gpt_run_resumes_bitwise(world):
    """A GPT run crashed at step 5 and resumed from step 3 ends bitwise under DDP and ZeRO-3."""
    for r in worlds.outcome(world(WORLD_SIZE), "resume"):
        for stage in (0, 3):
            straight, resumed, crashed, step = r[stage]
            assert crashed and step == STEPS
            assert torch.equal(straight, resumed), stage


def _initial(trainer: TinyGPTTrainer) -> torch.Tensor:
    torch.manual_seed(trainer.config.seed)  # as fit() seeds it before build_model()
    return flat_params(trainer.build_model())


def _compile_vs_eager(root: str, variants: list[tuple[int, bool]]) -> dict:
    out = {}
    for stage, ckpt in variants:
        eager = _fit(_config(root, f"e{stage}{ckpt}", zero_stage=stage))
        cfg = _config(root, f"c{stage}{ckpt}", zero_stage=stage, compile=True)
        compiled = _fit(replace(cfg, activation_checkpointing=ckpt))
        out[stage, ckpt] = {
            "eager": eager[1],
            "compiled": compiled[1],
            "initial": _initial(compiled[2]),
            "losses": (eager[0]["eval"]["eval_loss"], compiled[0]["eval"]["eval_loss"]),
        }
    return out


def _check_compiled(results: list[dict]) -> None:
    for r in results:
        for key, d in r.items():
            moved = (d["eager"] - d["initial"]).abs().max().item()
            diff = (d["compiled"] - d["eager"]).abs().max().item()
            print(f"compile vs eager, stage {key[0]}, checkpointed {key[1]}: {diff:.3g}")
            assert moved > 2 * COMPILE_ATOL
            assert diff <= COMPILE_ATOL
            assert d["losses"][1] == pytest.approx(d["losses"][0], rel=1e-2)


def _compile_world(root: str) -> dict:
    torch.set_num_threads(1)
    variants = [(0, False), (0, True), (3, False), (3, True)]
    cases = {"compile": lambda info: _compile_vs_eager(root, variants)}
    return worlds.run_cases(cases, ["compile"])


@pytest.mark.slow
def test_compile_trains_like_eager(tmp_path):
    """compile=True under DDP and ZeRO-3, checkpointed or not, moves the weights as eager does."""
    # DDP compiles the whole module, the wrapper eager; ZeRO-3 compiles each block's forward
    # between the wrapper's gathers.
    results = ddptrain.spawn(_compile_world, WORLD_SIZE, str(tmp_path), timeout_s=WORLD_TIMEOUT_S)
    _check_compiled(worlds.outcome(results, "compile"))


CASES = {
    "checkpointing": _case_checkpointing,
    "checkpointing_trainer": _case_checkpointing_trainer,
    "clip": _case_clip,
    "schedule": _case_schedule,
    "resume": _case_resume,
}


def _run_cases(root: str, names: list[str]) -> dict:
    torch.set_num_threads(1)
    cases = {
        k: functools.partial(f, root=root) if k != "checkpointing" else f for k, f in CASES.items()
    }
    return worlds.run_cases(cases, names)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """world(2): every case of this module from one spawned world of two ranks."""
    root = str(tmp_path_factory.mktemp("gpt"))
    results = ddptrain.spawn(_run_cases, WORLD_SIZE, root, list(CASES), timeout_s=WORLD_TIMEOUT_S)
    return lambda world_size: results
