"""Same bits at any world size (deterministic=True): the user's loop and the Trainer end on the
same parameters, buffers, optimizer state, logged loss and evaluation at world sizes 1-4, at
every ZeRO stage, and across resumes at other world sizes; the float reduction does not.

One spawned world per size runs the loops (worlds.run_cases); the resume chain spawns its own.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import ddptrain
from ddptrain.ddp import deterministic
from ddptrain.ddp.norm import exact_norm
from ddptrain.models import LeNet
from ddptrain.train.gradients import grad_norm
from support import worlds
from support.digests import tensors_digest
from support.doc_blocks import python_block

WORLD_TIMEOUT_S = 540
pytestmark = pytest.mark.timeout(WORLD_TIMEOUT_S + 60)

# 12 micro-batches a step: world sizes 1, 2, 3, 4 (and 6, 12) share them evenly.
GLOBAL, MICRO, STEPS = 24, 2, 3
# Below TiedBranchNet's gradient norms (about 2-3): every step clips.
CLIP_NORM = 0.5


class TiedBranchNet(nn.Module):
    """Tied input/output embeddings, a branch some micro-batches take (by their data, never by
    rank) and a layer no micro-batch uses."""

    def __init__(self, vocab: int = 20, dim: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.hidden = nn.Linear(dim, dim)
        self.branch = nn.Linear(dim, dim)
        self.never_used = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, vocab, bias=False)
        self.out.weight = self.embed.weight
        self.drop = nn.Dropout(0.2)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.hidden(self.drop(self.embed(tokens))))
        if int(tokens[0, 0]) % 3 == 0:
            h = h + torch.tanh(self.branch(h))
        return F.log_softmax(self.out(h), dim=-1)


def _data(kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    n = GLOBAL * STEPS
    if kind == "lenet":
        return torch.randn(n, 1, 28, 28, generator=g), torch.randint(0, 10, (n,), generator=g)
    return torch.randint(0, 20, (n, 6), generator=g), torch.randint(0, 20, (n, 6), generator=g)


def _loop(
    info, kind: str, stage: int = 0, deterministic: bool = True, max_norm: float | None = None
) -> dict:
    """The user's own loop: micro-batch k of a step is the same samples at any world size;
    one backward each under no_sync(), the last synchronized; with max_norm, the gradients
    clipped to it before each step (as the Trainer clips them)."""
    torch.manual_seed(0)
    if kind == "lenet":
        net = LeNet(dropout=0.3, width=1, batchnorm=True)
    else:
        # "wide": layers of 360,000 weights, past a piece: they take the compiled passes.
        net = TiedBranchNet(dim=600 if kind == "wide" else 16)
    if stage >= 2:
        model = ddptrain.FSDP(
            net, deterministic=True, reshard_after_forward=stage == 3, unit_min_numel=100
        )
    else:
        model = ddptrain.DDP(net, deterministic=deterministic)
    if stage == 1:
        opt = ddptrain.ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = _data(kind)
    world_size, rank = info.world_size, info.rank
    rounds = GLOBAL // (MICRO * world_size)
    norms = []
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        for j in range(rounds):
            k = step * GLOBAL // MICRO + j * world_size + rank
            xb, yb = x[k * MICRO : (k + 1) * MICRO], y[k * MICRO : (k + 1) * MICRO]
            with model.no_sync() if j < rounds - 1 else torch.enable_grad():
                out = model(xb)
                loss = F.nll_loss(out.reshape(-1, out.shape[-1]), yb.reshape(-1))
                (loss if deterministic else loss / rounds).backward()
        if max_norm is not None:
            norms.append(grad_norm(model, max_norm).item())
        opt.step()
    if stage >= 2:
        state, optim = model.state_dict(), model.optim_state_dict(opt)
    else:
        state, optim = net.state_dict(), opt.state_dict()
    tensors = [state[k] for k in sorted(state)]
    if optim is not None:
        tensors += [t for s in optim["state"].values() for t in s.values() if torch.is_tensor(t)]
    grads = [p.grad for p in net.parameters() if p.grad is not None] if stage < 2 else []
    return {
        "state": tensors_digest(tensors),
        "model": tensors_digest([state[k] for k in sorted(state)]),
        "never_used_grad": None if kind == "lenet" or stage >= 2 else net.never_used.weight.grad,
        "grads": len(grads),
        "norms": norms,
    }


def _case_lenet(info) -> dict:
    return _loop(info, "lenet")


def _case_tied_branch(info) -> dict:
    return _loop(info, "tied")


def _case_tied_finished(info) -> dict:
    """The tied-branch loop with every bucket's means computed by the transport, each rank
    its part (as a large bucket's are)."""
    kept, deterministic.FINISH_NUMEL = deterministic.FINISH_NUMEL, 0
    try:
        return _loop(info, "tied")
    finally:
        deterministic.FINISH_NUMEL = kept


def _wide_world() -> dict:
    info = ddptrain.init_distributed()
    try:
        return _loop(info, "wide")
    finally:
        ddptrain.shutdown()


def _case_float_sums(info) -> dict:
    return _loop(info, "lenet", deterministic=False)


def _case_stages(info) -> dict:
    return {stage: _loop(info, "lenet", stage=stage) for stage in (1, 2, 3)}


def _case_tied_stages(info) -> dict:
    """ZeRO-2 and ZeRO-3 with units of 100 elements: the branch and the unused layer are units
    of their own, which some ranks' micro-batches skip."""
    return {stage: _loop(info, "tied", stage=stage) for stage in (2, 3)}


def _case_tied_clipped(info) -> dict:
    """The DDP wrapper and ZeRO-3 clipping, and the bound on the gradient's elements each gives
    the exact norm (it sets the norm's grid)."""
    from ddptrain.fsdp import state as fsdp_state
    from ddptrain.train import gradients

    bounds: dict[int, list] = {0: [], 3: []}
    stage = 0

    def recording(grads, *args, **kwargs):
        bounds[stage].append(kwargs.get("numel"))
        return exact_norm(grads, *args, **kwargs)

    out = {}
    gradients.exact_norm = fsdp_state.exact_norm = recording
    try:
        for stage in (0, 3):
            out[stage] = _loop(info, "tied", stage=stage, max_norm=CLIP_NORM)
    finally:
        gradients.exact_norm = fsdp_state.exact_norm = exact_norm
    numel = sum(p.numel() for p in TiedBranchNet().parameters())
    return {**out, "bounds": bounds, "numel": numel}


def _case_guide_loop(info) -> str:
    """The guide's own-loop example, run as written on 192 samples (two steps)."""
    import contextlib

    from torch.utils.data import DataLoader

    g = torch.Generator().manual_seed(7)
    x, y = torch.randn(192, 1, 28, 28, generator=g), torch.randint(0, 10, (192,), generator=g)
    torch.manual_seed(0)
    net = LeNet(dropout=0.3, width=1, batchnorm=True)
    scope = {
        "contextlib": contextlib,
        "torch": torch,
        "F": F,
        "DataLoader": DataLoader,
        "ddptrain": ddptrain,
        "net": net,
        "dataset": TensorDataset(x, y),
        "opt": torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9),
        "rank": info.rank,
        "world_size": info.world_size,
    }
    exec(python_block("docs/guide.md", "ddptrain.DDP(net, deterministic=True)"), scope)
    state = net.state_dict()
    return tensors_digest([state[k] for k in sorted(state)])


CASES = {
    "lenet": _case_lenet,
    "guide_loop": _case_guide_loop,
    "tied_branch": _case_tied_branch,
    "tied_finished": _case_tied_finished,
    "float_sums": _case_float_sums,
    "stages": _case_stages,
    "tied_stages": _case_tied_stages,
    "tied_clipped": _case_tied_clipped,
}
BY_WORLD = {
    1: list(CASES),
    2: ["lenet", "tied_branch", "tied_finished", "tied_stages"],
    3: list(CASES),
    4: ["lenet", "tied_branch", "tied_finished", "guide_loop", "tied_stages"],
}
world = worlds.fixture(CASES, BY_WORLD, timeout_s=WORLD_TIMEOUT_S)


@pytest.mark.parametrize("kind", ["lenet", "tied_branch"])
def test_the_users_loop_ends_on_the_same_bits_at_world_sizes_1_to_4(world, kind):
    """The user's loop ends on the same parameters, buffers and AdamW state bits at sizes 1-4."""
    digests = {ws: {r["state"] for r in worlds.outcome(world(ws), kind)} for ws in (1, 2, 3, 4)}
    assert all(len(d) == 1 for d in digests.values()), digests
    assert len(set.union(*digests.values())) == 1, digests
    if kind == "tied_branch":
        assert all(r["never_used_grad"] is None for r in worlds.outcome(world(3), kind))


def test_means_the_transport_computes_part_by_part_give_the_same_bits(world):
    """Bucket means computed part by part by the transport end on world size 1's bits at 2, 3, 4."""
    want = {r["state"] for r in worlds.outcome(world(1), "tied_branch")}
    for ws in (2, 3, 4):
        results = worlds.outcome(world(ws), "tied_finished")
        assert {r["state"] for r in results} == want, ws
        assert all(r["never_used_grad"] is None for r in results)


@pytest.mark.slow
def test_layers_past_a_piece_end_on_the_same_bits_at_world_sizes_1_2_3():
    """Layers of 360,000 weights, through the compiled passes, end on the same bits at sizes 1-3."""
    # Slow: each rank compiles, about 20 s on 2 cores with a cold compiler cache.
    digests = set()
    for ws in (1, 2, 3):
        digests |= {r["state"] for r in ddptrain.spawn(_wide_world, ws, timeout_s=300)}
    assert len(digests) == 1, digests


def test_the_guides_own_loop_ends_on_the_same_bits_at_world_sizes_1_3_4(world):
    """The guide's own-loop example ends on the same LeNet bits at world sizes 1, 3 and 4."""
    digests = {r for ws in (1, 3, 4) for r in worlds.outcome(world(ws), "guide_loop")}
    assert len(digests) == 1, digests


def test_the_float_reduction_changes_with_the_world_size(world):
    """Float sums (deterministic=False) end on other bits at sizes 1 and 3; exact sums do not."""
    # The oracle can fail: it catches a loop whose bits depend on the world size.
    one, three = (worlds.outcome(world(ws), "float_sums")[0]["model"] for ws in (1, 3))
    assert one != three
    exact = {worlds.outcome(world(ws), "lenet")[0]["model"] for ws in (1, 3)}
    assert len(exact) == 1


def test_zero_stages_1_2_3_end_on_the_ddp_wrappers_bits(world):
    """Deterministic ZeRO-1, 2 and 3 end on the DDP wrapper's bits at world sizes 1 and 3."""
    ddp = worlds.outcome(world(1), "lenet")[0]["model"]
    for ws in (1, 3):
        for stage in (1, 2, 3):
            assert {r[stage]["model"] for r in worlds.outcome(world(ws), "stages")} == {ddp}


def test_zero_2_and_3_with_a_branch_some_ranks_skip_end_on_the_ddp_wrappers_bits(world):
    """ZeRO-2 and 3 with units some ranks skip end on the DDP wrapper's state bits at sizes 1-4."""
    ddp = worlds.outcome(world(1), "tied_branch")[0]["state"]
    for ws in (1, 2, 3, 4):
        for stage in (2, 3):
            assert {r[stage]["state"] for r in worlds.outcome(world(ws), "tied_stages")} == {ddp}


def test_clipped_norms_of_zero_3_equal_the_ddp_wrappers_with_a_layer_no_rank_uses(world):
    """DDP and ZeRO-3 clipping give the same norm bits every step and end bitwise at sizes 1, 3."""
    # Both bound the norm's terms by the whole model's elements, the unused layer's included:
    # the same grid whatever the gradients.
    ddp = worlds.outcome(world(1), "tied_clipped")[0][0]
    assert all(n > CLIP_NORM for n in ddp["norms"]), ddp["norms"]
    for ws in (1, 3):
        for r in worlds.outcome(world(ws), "tied_clipped"):
            for stage in (0, 3):
                assert r[stage]["norms"] == ddp["norms"], (ws, stage, r[stage]["norms"])
                assert r[stage]["state"] == ddp["state"], (ws, stage)
                assert r["bounds"][stage] == [r["numel"]] * STEPS, (ws, stage, r["bounds"])
