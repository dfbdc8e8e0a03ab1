"""The model's own step, measured on one process: what the plan scales to other world sizes.

    prof = profile(Setup(model="mlp", strategy="ddp"))          # a fresh process, a few steps
    prof.forward_s, prof.backward_s, prof.optimizer_s            # CPU seconds, median of steps
    prof.bucket_ready_s[b]   # bucket b reached the comm hook this long into backward (DDP)
    prof.hook_s[b]           # the comm hook's own seconds on bucket b (PowerSGD's compression)
    prof.ready_s[i]          # parameter i's gradient was ready this long into backward (sharded)
    prof.peak_rss_bytes      # peak RSS while training, this strategy at world size 1
    prof.step_samples_s      # every timed step's seconds: how much one step varies

The DDP strategies run in a world of one (ddptrain.spawn), wrapped as at any world size, so
the wrapper's own work (filling buckets, the PowerSGD hook's compression, timed per bucket) is
in the times; what a world of one does not do, sending, the plan adds from the link. The
sharded strategies run the plain model, with a forward pre-hook and hook on each unit the
sharded wrapper would make (fsdp/layout.py's choose_units): their gathers and copies are the
plan's to add. The strategy's own step, unmarked, is timed too (`wrapper_step_s`): on CUDA
apart, on CPU the sharded wrapper's in alternation with the plain model's.
Marks: the comm hook, wrapped, notes when each bucket reaches it (DDP strategies); a hook after
each parameter's gradient is accumulated (sharded).

What a second and a byte are depends on the setup's device (meter.py). CPU: CPU seconds of the
thread that runs the step (autograd runs a CPU backward on it), so other programs' load
inflates them less than wall time: the plan shares the cores out itself (timeline.py); memory
is RSS, glibc returning freed blocks at once, as in --check (run.py). CUDA: the device's
seconds between events recorded at each span's edge and at each mark (on the stream the work
runs on; nothing waits at a mark, the step ends in a synchronize); memory is the caching
allocator's (the `*_rss_*` fields then hold memory_allocated before the model and
max_memory_allocated while training; the CUDA context is in neither). Saved-tensor hooks count
the activations of one forward (distinct storages on the setup's device, not parameters), by
the unit whose forward saved them.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

import ddptrain
from ddptrain.bench.memory import return_freed_memory
from ddptrain.fsdp.layout import choose_units
from ddptrain.plan.marks import HookTimer, Marks, activation_bytes
from ddptrain.plan.meter import Meter, meter_for
from ddptrain.plan.setup import OPTIMIZERS, Setup, build, rank_env

SHARDED = ("zero2", "zero3")

WARMUP_STEPS = 3
# Fresh interpreters, as torchrun and srun start ranks: a rank forked from ddptrain.spawn's
# forkserver inherits pages it would otherwise fault in while training (a lower peak RSS), so
# profile and --check start every rank so.
START_METHOD = "spawn"
# A guest's CPU runs up to a third slower for a second or two at a time: the median of eight
# MLP steps moved 15-24% between profiles, of 60 steps (4 s) 6-10%.
TIMED_STEPS = 8
MIN_TIMED_S = 2.0
MAX_TIMED_STEPS = 400


def start_method(device: str) -> str | None:
    """How ranks of `device` start: CPU ranks as START_METHOD says; CUDA ranks from
    ddptrain.spawn's forkserver (torch imported once, seconds saved a rank), since the
    allocator's bytes they are measured by hold nothing a fork inherits."""
    return START_METHOD if device == "cpu" else None


@dataclass
class Profile:
    """One strategy's step at world size 1, in seconds and bytes (see the module docstring)."""

    setup: dict[str, Any]
    param_names: list[str]
    param_numels: list[int]
    param_shapes: list[list[int]]
    element_bytes: int
    step_s: float
    wall_step_s: float
    forward_s: float
    backward_s: float
    optimizer_s: float
    # Sharded strategies: per parameter, CPU seconds into backward its gradient was ready.
    ready_s: list[float] = field(default_factory=list)
    buckets: list[list[int]] = field(default_factory=list)  # parameter indices, launch order
    # DDP strategies, per bucket: CPU seconds into backward it was handed to the comm hook,
    # and the hook's own CPU seconds on it (PowerSGD's compression).
    bucket_ready_s: list[float] = field(default_factory=list)
    hook_s: list[float] = field(default_factory=list)
    # Sharded strategies: per unit, its parameter indices; its forward's start and end (s
    # from the step's start, the unit's own compute between them less its children's).
    units: list[list[int]] = field(default_factory=list)
    unit_forward_s: list[list[float]] = field(default_factory=list)
    activation_bytes: int = 0
    unit_activation_bytes: list[int] = field(default_factory=list)
    rss_before_model_bytes: int = 0
    peak_rss_bytes: int = 0
    optimizer_state_bytes: int = 0
    device: str = "cpu"  # what the seconds and bytes are of (the module docstring)
    timed_steps: int = 0  # the medians are over this many steps
    step_samples_s: list[float] = field(default_factory=list)  # each timed step's seconds
    # The strategy's own step at world size 1, as --check builds it, with no marks. On CUDA
    # (median) the DDP wrapper's strategies have their spans scaled to it by marks_scale. For
    # the sharded ones its excess over step_s is the wrapper's own work, which the plan charges
    # (steps.py); on CPU that excess is timed against the plain model's step in alternation
    # (wrapper_excess_s) and added to step_s. 0: not measured (the DDP wrapper's on CPU, whose
    # profile is its own step).
    wrapper_step_s: float = 0.0
    marks_scale: float = 1.0

    @property
    def param_bytes(self) -> int:
        return sum(self.param_numels) * self.element_bytes

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def hook_in_backward_s(self, strategy: str) -> float:
        """Of backward_s, the comm hook's own seconds: PowerSGD's last bucket's hook, which at
        world size 1 runs on the training thread at the end of backward."""
        return self.hook_s[-1] if strategy == "powersgd" and self.hook_s else 0.0


def profile(setup: Setup, timeout_s: float = 600.0, min_timed_s: float = MIN_TIMED_S) -> Profile:
    """Profile `setup` in a fresh process (a world of one) on the setup's device, timing
    steps for at least `min_timed_s` of wall time."""
    (raw,) = ddptrain.spawn(
        _profile_rank,
        1,
        setup.as_dict(),
        min_timed_s,
        timeout_s=timeout_s,
        start_method=start_method(setup.device),
        env=rank_env(setup.device),
    )
    return Profile(**raw)


def _profile_rank(setup_dict: dict[str, Any], min_timed_s: float) -> dict[str, Any]:
    setup = Setup(**setup_dict)
    return measure(setup, meter_for(setup.device), min_timed_s)


def rank_device(setup: Setup) -> torch.device:
    """Join a world (gloo for CPU ranks, NCCL for CUDA ones) and return this rank's device."""
    info = ddptrain.init_distributed(backend="gloo" if setup.device == "cpu" else None)
    if setup.device == "cuda" and info.device.type != "cuda":
        raise RuntimeError(f"setup wants cuda, but this rank got {info.device} ({info.backend})")
    return torch.device("cpu") if setup.device == "cpu" else info.device


def measure(setup: Setup, meter: Meter, min_timed_s: float = MIN_TIMED_S) -> dict[str, Any]:
    """Collective: the profile's fields, measured on this rank of a world of one with `meter`
    (the CPU's, CUDA's, or a test's stand-in), over steps timed for at least `min_timed_s`
    of wall time (TIMED_STEPS to MAX_TIMED_STEPS of them)."""
    return_freed_memory()
    device = rank_device(setup)
    work = setup.workload
    before_model = meter.allocated_bytes()
    sharded = setup.strategy in SHARDED
    hook_timer = None if sharded else HookTimer(meter)
    if sharded:
        # The sharded wrapper's gathers and copies are the plan's to add: its compute is the
        # plain model's, timed unit by unit.
        torch.manual_seed(0)
        model = work.factory().to(device=device, dtype=setup.dtype)
        optimizer = OPTIMIZERS[setup.optimizer](model.parameters(), lr=1e-3)
        plain, unit_modules = model, choose_units(model, None)
    else:
        # Marks on the parameters would turn off the slots large Linear layers compute their
        # gradients into (cpu/linear_slots.py): the comm hook, timed, marks each bucket.
        model, optimizer = build(setup, device, hook_timer.wrap)
        plain, unit_modules = model.module, []
    named = list(plain.named_parameters())
    names = [n for n, _ in named]
    params = [p for _, p in named]
    shapes = [list(p.shape) for p in params]
    numels = [p.numel() for p in params]
    marks = Marks(meter, plain, params, unit_modules, param_hooks=sharded)
    x, y = work.batch(torch.Generator().manual_seed(0))
    if x.is_floating_point():
        x = x.to(setup.dtype)
    x, y = x.to(device), y.to(device)
    meter.reset_peak()
    times: dict[str, list[float]] = {
        k: [] for k in ("wall", "step", "forward", "backward", "optimizer")
    }
    ready: list[list[float]] = []
    unit_forward: list[list[list[float]]] = []
    hooks: list[list[float]] = []
    bucket_ready: list[list[float]] = []
    for timed in _steps(min_timed_s):
        marks.clear()
        if hook_timer is not None:
            hook_timer.clear()
        meter.start()
        wall, s0 = time.perf_counter(), meter.stamp()
        optimizer.zero_grad(set_to_none=True)
        loss = work.loss(model(x), y)
        s1 = meter.stamp()
        loss.backward()
        s2 = meter.stamp()
        optimizer.step()
        s3 = meter.stamp()
        meter.finish()
        if not timed:
            continue
        t0, t1, t2, t3 = (meter.seconds(s) for s in (s0, s1, s2, s3))
        times["wall"].append(time.perf_counter() - wall)
        times["step"].append(t3 - t0)
        times["forward"].append(t1 - t0)
        times["backward"].append(t2 - t1)
        times["optimizer"].append(t3 - t2)
        ready.append(marks.ready_offsets(t1))
        unit_forward.append(marks.forward_spans(t0))
        if hook_timer is not None:
            hooks.append(hook_timer.own_seconds())
            bucket_ready.append([t - t1 for t in hook_timer.ready_seconds()])
    peak = meter.peak_bytes()
    activations, per_unit = activation_bytes(model, work, x, y, params, marks, device)
    wrapper_s = 0.0
    if meter.device == "cuda":
        wrapper_s = _wrapper_step_s(setup, device, meter, x, y, min_timed_s)
    elif sharded:
        plain_step = _step_timer(setup, device, meter, x, y, wrapped=False)
        wrapped_step = _step_timer(setup, device, meter, x, y, wrapped=True)
        own = wrapper_excess_s(plain_step, wrapped_step, min_timed_s)
        wrapper_s = statistics.median(times["step"]) + own
    fields = {
        "setup": setup.as_dict(),
        "param_names": names,
        "param_numels": numels,
        "param_shapes": shapes,
        "element_bytes": params[0].element_size(),
        "step_s": statistics.median(times["step"]),
        "wall_step_s": statistics.median(times["wall"]),
        "forward_s": statistics.median(times["forward"]),
        "backward_s": statistics.median(times["backward"]),
        "optimizer_s": statistics.median(times["optimizer"]),
        "ready_s": _median_rows(ready) if sharded else [],
        "buckets": [] if sharded else _bucket_members(model, names),
        "bucket_ready_s": _median_rows(bucket_ready) if bucket_ready else [],
        "hook_s": _median_rows(hooks) if setup.strategy == "powersgd" else [],
        "units": marks.unit_members(),
        "unit_forward_s": [_median_rows(list(u)) for u in zip(*unit_forward, strict=True)]
        if unit_forward and unit_forward[0]
        else [],
        "activation_bytes": activations,
        "unit_activation_bytes": per_unit,
        "rss_before_model_bytes": before_model,
        "peak_rss_bytes": peak,
        "optimizer_state_bytes": _state_bytes(optimizer),
        "device": setup.device,
        "timed_steps": len(times["step"]),
        "step_samples_s": times["step"],
        "wrapper_step_s": wrapper_s,
        "marks_scale": 1.0,
    }
    return fields if sharded or not wrapper_s else _scaled_to(fields, wrapper_s)


def _scaled_to(fields: dict[str, Any], step_s: float) -> dict[str, Any]:
    """The DDP wrapper's profile with its spans scaled to `step_s`, its step with no marks.
    On a GPU a small model's step is bound by the host, and the marks (an event at each span's
    edge and bucket, the timed hook, which turns off the wrapper's path that builds no future)
    are host work of their own: on an H200 the marked profiles of DDP and ZeRO-1 came out 1.11x
    their runs on average (12 rows, 0.96-1.24), the unmarked ZeRO-3 steps 0.99x."""
    factor = step_s / fields["step_s"]
    out = dict(fields, marks_scale=factor)
    for name in ("step_s", "wall_step_s", "forward_s", "backward_s", "optimizer_s"):
        out[name] = fields[name] * factor
    for name in ("bucket_ready_s", "hook_s", "step_samples_s"):
        out[name] = [t * factor for t in fields[name]]
    return out


def _wrapper_step_s(
    setup: Setup,
    device: torch.device,
    meter: Meter,
    x: torch.Tensor,
    y: torch.Tensor,
    min_timed_s: float,
) -> float:
    """Collective: the strategy's step at world size 1 as --check builds it (no marks, no
    timed hook), median seconds, each step timed as the profile's are. On a GPU a small
    model's step is bound by the host launching kernels, and the sharded wrapper's per-unit
    Python work (gathers and frees that a world of one makes no-ops of) then lengthens the
    plain model's 1.3-2.7x (an H200: the MLP 2.5 -> 6.7 ms)."""
    step = _step_timer(setup, device, meter, x, y, wrapped=True)
    times = []
    for timed in _steps(min_timed_s):
        seconds = step()
        if timed:
            times.append(seconds)
    return statistics.median(times)


def _step_timer(
    setup: Setup,
    device: torch.device,
    meter: Meter,
    x: torch.Tensor,
    y: torch.Tensor,
    wrapped: bool,
) -> Callable[[], float]:
    """Collective: a function that takes one training step of `setup`'s model, unmarked, wrapped
    as --check builds it or plain, and returns its seconds."""
    work = setup.workload
    if wrapped:
        model, optimizer = build(setup, device)
    else:
        torch.manual_seed(0)
        model = work.factory().to(device=device, dtype=setup.dtype)
        optimizer = OPTIMIZERS[setup.optimizer](model.parameters(), lr=1e-3)

    def step() -> float:
        meter.start()
        s0 = meter.stamp()
        optimizer.zero_grad(set_to_none=True)
        work.loss(model(x), y).backward()
        optimizer.step()
        s1 = meter.stamp()
        meter.finish()
        return meter.seconds(s1) - meter.seconds(s0)

    return step


def wrapper_excess_s(
    plain: Callable[[], float], wrapped: Callable[[], float], min_timed_s: float
) -> float:
    """How much longer `wrapped()`'s step is than `plain()`'s: the median of their differences
    over pairs taken back to back (which goes first alternating), at least 0. A guest's CPU
    slows for seconds at a time: LeNet's plain step, profiled minutes apart, took 29-40 ms, the
    sharded wrapper's own work about 2 ms of it; a pair shares its spell."""
    excess = []
    for n, timed in enumerate(_steps(min_timed_s)):
        first, second = (plain, wrapped) if n % 2 == 0 else (wrapped, plain)
        a, b = first(), second()
        if timed:
            excess.append(b - a if first is plain else a - b)
    return max(0.0, statistics.median(excess))


def _steps(min_timed_s: float) -> Iterator[bool]:
    """Once per step, whether it is timed: WARMUP_STEPS untimed, then timed ones until they
    are enough (_enough)."""
    for _ in range(WARMUP_STEPS):
        yield False
    timed, timed_from = 0, time.perf_counter()
    while not _enough(timed, time.perf_counter() - timed_from, min_timed_s):
        yield True
        timed += 1


def _enough(timed: int, timed_s: float, min_timed_s: float) -> bool:
    """Whether `timed` steps over `timed_s` seconds of wall time make a profile."""
    if timed < TIMED_STEPS:
        return False
    return timed >= MAX_TIMED_STEPS or timed_s >= min_timed_s


def _median_rows(rows: list[list[float]]) -> list[float]:
    return [statistics.median(column) for column in zip(*rows, strict=True)]


def _bucket_members(model: nn.Module, names: list[str]) -> list[list[int]]:
    index = {n: i for i, n in enumerate(names)}
    return [[index[n] for n in bucket] for bucket in model.bucket_param_names]


def _state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(
        v.numel() * v.element_size()
        for s in optimizer.state.values()
        for v in s.values()
        if torch.is_tensor(v)
    )
