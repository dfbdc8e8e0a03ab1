"""Launch a function on N local processes, torchrun-style, from a script, notebook or test.

    def train(lr):
        info = ddptrain.init_distributed()
        ...
        return final_loss

    results = ddptrain.spawn(train, 2, 0.1, timeout_s=120)   # [loss of rank 0, loss of rank 1]

`fn` must be importable by the fresh processes (defined in a .py module, not a notebook cell,
which is refused up front), as with any multiprocessing "spawn" start. On Linux the workers
are forked from a forkserver that has imported torch once (Python 3.14's default start method),
so a world starts in a tenth of a second instead of a fresh torch import (2-3 s) per rank; each
worker still gets the caller's current environment variables. Each worker gets
RANK/LOCAL_RANK/WORLD_SIZE and a private `file://` rendezvous (no port to race for), so
`init_distributed()` inside it joins the group. A worker's exception is re-raised here with
its rank and traceback; on any failure or timeout every other worker is killed.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

from ddptrain.dist import INIT_METHOD_ENV
from ddptrain.launch.report import REPORT_DIR_ENV

_POLL_S = 0.05
# Imported once by the forkserver, not by every worker: torch (~2 s here) and torch._dynamo,
# which the first optimizer a process builds imports (~3 s here).
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "ddptrain"]


class WorkerError(RuntimeError):
    """A spawned worker raised; carries its rank and formatted traceback."""

    def __init__(self, rank: int, message: str, tb: str):
        super().__init__(f"rank {rank} failed: {message}\n\n--- traceback of rank {rank} ---\n{tb}")
        self.rank = rank
        self.worker_traceback = tb


def spawn(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 600.0,
    threads_per_rank: int | None = 1,
    env: dict[str, str] | None = None,
    start_method: str | None = None,
) -> list[Any]:
    """Run `fn(*args)` on `world_size` fresh processes; return each rank's result, by rank.

    `start_method`: "forkserver" (the default where the platform has it) or "spawn". Settings
    read once when torch is imported (e.g. OMP_NUM_THREADS) come from the forkserver's start,
    the first spawn of this process: pass "spawn" to change them between calls.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    _check_importable(fn)
    ctx = _context(start_method)
    results: Any = ctx.Queue()
    rendezvous_dir = tempfile.mkdtemp(prefix="ddptrain-spawn-")
    init_method = f"file://{os.path.join(rendezvous_dir, 'store')}"
    procs = []
    try:
        for rank in range(world_size):
            worker_env = {
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": str(world_size),
                "LOCAL_WORLD_SIZE": str(world_size),
                INIT_METHOD_ENV: init_method,
                **(env or {}),
            }
            # A forkserver child inherits the server's environment, not this process's now. Not
            # a ddptrain-run report folder this process may have: these ranks are not its workers.
            inherited = {k: v for k, v in os.environ.items() if k != REPORT_DIR_ENV}
            worker_env = {**inherited, **worker_env}
            # Not daemonic: a daemonic process may not start children, so a rank could not use
            # DataLoader(num_workers > 0). The finally below kills every worker still alive.
            p = ctx.Process(
                target=_worker, args=(fn, args, rank, worker_env, threads_per_rank, results)
            )
            p.start()
            procs.append(p)
        return _collect(procs, results, timeout_s)
    finally:
        for p in procs:
            _kill_tree(p)
        for p in procs:
            p.join(timeout=10)
        results.close()
        shutil.rmtree(rendezvous_dir, ignore_errors=True)


def _check_importable(fn: Callable[..., Any]) -> None:
    """Refuse, before any worker starts, a function the fresh workers cannot import: one
    defined in a notebook cell or the REPL (a `__main__` that has no file to re-run)."""
    if getattr(fn, "__module__", None) != "__main__":
        return
    main_file = getattr(sys.modules["__main__"], "__file__", None)
    if main_file and os.path.isfile(main_file):
        return  # a script: each worker re-runs it (under its own name) to find fn
    name = getattr(fn, "__qualname__", repr(fn))
    raise ValueError(
        f"spawn({name}, ...): {name} is defined in an interactive session (a notebook cell or "
        "the REPL), which the worker processes cannot import; define it in a .py module next "
        "to the notebook and import it from there"
    )


def _context(start_method: str | None) -> Any:
    if start_method is None:
        start_method = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
    if start_method not in ("forkserver", "spawn"):
        raise ValueError(f"start_method must be 'forkserver' or 'spawn', got {start_method!r}")
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        # Takes effect when the server starts (the first forkserver start in this process).
        ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _collect(procs: list, results: Any, timeout_s: float) -> list[Any]:
    deadline = time.monotonic() + timeout_s
    world_size = len(procs)
    out: dict[int, Any] = {}
    while len(out) < world_size:
        try:
            _take(results.get(timeout=_POLL_S), out)
        except queue.Empty:
            exited = [r for r, p in enumerate(procs) if r not in out and p.exitcode is not None]
            if exited:
                # A worker's last put can reach the pipe after the get above gave up and before
                # its exit code shows: read what is queued before calling it lost.
                _drain(results, out)
                for rank in exited:
                    if rank not in out:
                        raise WorkerError(
                            rank,
                            f"process exited with code {procs[rank].exitcode} without a result",
                            "",
                        ) from None
            if time.monotonic() > deadline:
                missing = sorted(set(range(world_size)) - set(out))
                raise TimeoutError(
                    f"spawn timed out after {timeout_s:.0f}s; ranks {missing} did not finish "
                    "(a collective run on only some ranks is the usual cause)"
                ) from None
    return [out[r] for r in range(world_size)]


def _take(item: tuple, out: dict[int, Any]) -> None:
    rank, ok, payload = item
    if not ok:
        raise WorkerError(rank, *payload)
    out[rank] = pickle.loads(payload)


def _drain(results: Any, out: dict[int, Any]) -> None:
    try:
        while True:
            _take(results.get(timeout=0.5), out)
    except queue.Empty:
        return


def _kill_tree(p: Any) -> None:
    """Kill a worker and anything it started (DataLoader workers): its own process group."""
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # the worker and its children are gone already
    if p.is_alive():
        p.kill()


def _worker(fn, args, rank, env, threads_per_rank, results) -> None:
    # A process group of its own, so that spawn can kill its children with it.
    os.setpgrp()
    os.environ.clear()
    os.environ.update(env)
    # multiprocessing hands its start method down to children; a rank starts its own (its
    # DataLoader workers) as under torchrun, with the platform's default.
    mp.set_start_method(None, force=True)
    import torch
    import torch.distributed as dist

    if threads_per_rank is not None:
        torch.set_num_threads(threads_per_rank)
    try:
        value = fn(*args)
    except BaseException as e:  # noqa: BLE001 - every failure must reach the parent
        results.put((rank, False, (f"{type(e).__name__}: {e}", traceback.format_exc())))
        return
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    # Plain pickle bytes: torch's queue pickler would share tensors through file descriptors
    # that vanish when this process exits before the parent reads them.
    results.put((rank, True, pickle.dumps(value)))
