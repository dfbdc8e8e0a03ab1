"""Process-group setup: the ONLY module that reads launcher environment.

    info = init_distributed()          # torchrun, srun, mpirun, ddptrain.spawn, or a world of 1
    print0(f"rank {info.rank} of {info.world_size} on {info.device} via {info.launcher}")
    loss = all_reduce_mean(loss)       # no-op at world size 1
    shutdown()

It reads os.environ and hands it to the pure parsers in ddptrain.launch.env (which launcher
wins when several left variables, and why: see there; commands: docs/launch.md). One process
is simply world_size 1 of the same path: without launcher variables, `init_distributed` still
creates a process group (a private in-memory store), so every collective in ddptrain runs
unchanged.
"""

from __future__ import annotations

import datetime
import gc
import os
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ddptrain.ddp.hooks import run_closers, set_timeout_s
from ddptrain.launch.env import INIT_METHOD_ENV as INIT_METHOD_ENV  # spawn and tests set it here
from ddptrain.launch.env import LaunchError, detect_launcher, expand_nodelist, parse_env
from ddptrain.launch.rendezvous import address_in_use, env_store

DEFAULT_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits in the job."""

    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    backend: str
    launcher: str = "single"  # "torchrun", "spawn", "mpi", "slurm" or "single" (no launcher)
    # The torchrun agent that started this process (its parent), watched by the heartbeat.
    agent_pid: int | None = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def resolve_backend(requested: str | None, cuda_available: bool) -> str:
    """Pick the backend: nccl when CUDA is there, else gloo; refuse impossible requests."""
    backend = requested or ("nccl" if cuda_available else "gloo")
    if backend == "nccl" and not cuda_available:
        raise LaunchError(
            "backend 'nccl' needs CUDA, but torch.cuda.is_available() is False on this machine; "
            "use backend='gloo' (or leave backend=None to choose automatically)"
        )
    return backend


def resolve_device(backend: str, local_rank: int, cuda_count: int) -> torch.device:
    """The device this rank computes on: cuda:local_rank under CUDA, else cpu."""
    if backend != "nccl" and cuda_count == 0:
        return torch.device("cpu")
    if cuda_count == 0:
        return torch.device("cpu")
    if local_rank >= cuda_count:
        raise LaunchError(
            f"LOCAL_RANK={local_rank} but only {cuda_count} CUDA device(s) are visible; "
            f"use --nproc_per_node <= {cuda_count} (one process per GPU), or hide the GPUs "
            "(CUDA_VISIBLE_DEVICES=) to run every rank on CPU with gloo"
        )
    return torch.device("cuda", local_rank)


# Default groups this process has created. A file:// rendezvous used again (a second
# Trainer.fit() after the first destroyed its group) must not show the new group the last one's
# keys: torch numbers groups from 0 again, so ranks would read dead addresses and fail or hang.
# Every rank creates its groups in the same order, so all agree on the number. (The env:// store
# gets a fresh token per group instead: launch/rendezvous.py.)
_groups_created = 0


def _next_group() -> int:
    global _groups_created
    _groups_created += 1
    return _groups_created


def _fresh_file(method: str, group: int) -> str:
    """The n-th group on a file:// path uses "path.n": torch's FileStore needs a new file per
    group, and a peer still holding the old one keeps it alive with the last group's keys."""
    if not method.startswith("file://") or group == 1:
        return method
    return f"{method}.{group}"


def init_distributed(
    backend: str | None = None,
    init_method: str | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    env: Mapping[str, str] | None = None,
) -> DistInfo:
    """Join (or create) the default process group and return where this process sits.

    `init_method` accepts "env://", "tcp://host:port" and "file:///path"; left as None it is
    taken from the launcher. Calling it again when a group exists returns the current info;
    after shutdown() it creates a new group (the n-th on a file:// path uses "path.n").
    """
    launch = parse_env(os.environ if env is None else env, expand_hosts=_expand_hosts)
    cuda_available = torch.cuda.is_available()
    if dist.is_initialized():
        return current_info()
    backend = resolve_backend(backend, cuda_available)
    device = resolve_device(backend, launch.local_rank, torch.cuda.device_count())
    if device.type == "cuda":
        torch.cuda.set_device(device)
    method = init_method or launch.init_method
    kwargs = {}
    if device.type == "cuda" and backend == "nccl":
        # Binds NCCL's communicator to this rank's GPU; gloo carries any device's tensors.
        kwargs["device_id"] = device
    timeout = datetime.timedelta(seconds=timeout_s)
    set_timeout_s(timeout_s)
    group = _next_group()
    try:
        if method is None:
            # A world of one still gets a real process group, so no code path is single-process
            # only; its store lives in memory, so nothing is left on disk, even by a killed run.
            kwargs["store"] = dist.HashStore()
        elif method == "env://":
            kwargs["store"] = env_store(launch, timeout)
        else:
            kwargs["init_method"] = _fresh_file(method, group)
        dist.init_process_group(
            backend=backend,
            rank=launch.rank,
            world_size=launch.world_size,
            timeout=timeout,
            **kwargs,
        )
    except RuntimeError as e:
        # torch's text ("The server socket has failed to listen on any local network
        # address...") names neither MASTER_PORT nor the fix.
        if "EADDRINUSE" not in str(e) and "address already in use" not in str(e).lower():
            raise
        raise LaunchError(address_in_use(method, launch)) from None
    if dist.get_world_size() != launch.world_size:
        got = dist.get_world_size()
        shutdown()
        raise LaunchError(
            f"process group has world_size {got} but WORLD_SIZE={launch.world_size}; "
            "every process must be launched with the same WORLD_SIZE"
        )
    return DistInfo(
        launch.rank,
        launch.local_rank,
        launch.world_size,
        device,
        backend,
        launch.launcher,
        os.getppid() if launch.elastic_agent else None,
    )


def _expand_hosts(nodelist: str) -> list[str]:
    """SLURM's node list as host names; `scontrol show hostnames` for forms the parser refuses."""
    try:
        return expand_nodelist(nodelist)
    except ValueError as e:
        if shutil.which("scontrol") is None:
            raise LaunchError(f"{e}; export MASTER_ADDR=<rank 0's host>") from None
        out = subprocess.run(
            ["scontrol", "show", "hostnames", nodelist],
            capture_output=True,
            text=True,
            timeout=30,
        )
        if out.returncode != 0:
            raise LaunchError(
                f"{e}, and `scontrol show hostnames` failed too ({out.stderr.strip()}); "
                "export MASTER_ADDR=<rank 0's host>"
            ) from None
        return out.stdout.split()


def launched_by() -> str:
    """The launcher that started this process ("single" when none did), before any group exists."""
    return detect_launcher(os.environ)


def current_info() -> DistInfo:
    """DistInfo of the already-initialized default group."""
    if not dist.is_initialized():
        raise RuntimeError("no process group: call ddptrain.init_distributed() first")
    backend = dist.get_backend()
    launch = parse_env(os.environ, expand_hosts=_expand_hosts)
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else None
    return DistInfo(
        dist.get_rank(),
        launch.local_rank,
        dist.get_world_size(),
        device or torch.device("cpu"),
        backend,
        launch.launcher,
        os.getppid() if launch.elastic_agent else None,
    )


def shutdown() -> None:
    """Free what is garbage but not yet collected, close what was registered with
    close_at_shutdown (transports), then destroy every process group (safe to call twice)."""
    # A wrapper left in a reference cycle (its hooks refer to it) holds gloo work and groups;
    # freed after the groups are destroyed, at the interpreter's exit, it can abort the rank
    # ("terminate called without an active exception").
    gc.collect()
    run_closers()
    if dist.is_initialized():
        dist.destroy_process_group()


def is_main() -> bool:
    """True on rank 0 (read from the launcher when no process group exists yet or any more)."""
    if dist.is_initialized():
        return dist.get_rank() == 0
    return parse_env(os.environ, expand_hosts=_expand_hosts).rank == 0


def print0(*args: object, **kwargs: object) -> None:
    """print() on rank 0 only, as one write (processes sharing a terminal do not interleave
    inside the line)."""
    if is_main():
        sep, end = kwargs.pop("sep", " "), kwargs.pop("end", "\n")
        print(sep.join(map(str, args)) + end, end="", **kwargs, flush=True)


def _reduce(value: float | torch.Tensor, average: bool) -> float | torch.Tensor:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        # The same types as with more ranks: a new tensor (never the input), or a float.
        return value.clone() if isinstance(value, torch.Tensor) else float(value)
    is_number = not isinstance(value, torch.Tensor)
    device = (
        torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    )
    t = (
        torch.tensor(float(value), dtype=torch.float64, device=device)
        if is_number
        else value.clone()
    )
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    if average:
        t = t / dist.get_world_size()
    return t.item() if is_number else t


def all_reduce_sum(value: float | torch.Tensor) -> float | torch.Tensor:
    """Sum of a number or tensor over ranks (a new value; the input is untouched)."""
    return _reduce(value, average=False)


def all_reduce_mean(value: float | torch.Tensor) -> float | torch.Tensor:
    """Mean of a number or tensor over ranks (a new value; the input is untouched)."""
    return _reduce(value, average=True)


def broadcast_object(obj: object, src: int = 0) -> object:
    """Rank `src`'s Python object, on every rank (decisions are made on rank 0 and sent)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]
