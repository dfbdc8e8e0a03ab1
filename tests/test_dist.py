"""Environment parsing and process-group setup (monkeypatched env, one real world of size 1)."""

import gc
import os
import pickle
import queue
import tempfile
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import ddptrain
from ddptrain.comm import named_hook
from ddptrain.dist import (
    INIT_METHOD_ENV,
    parse_env,
    resolve_backend,
    resolve_device,
)
from ddptrain.launch.spawn import _collect


def test_no_launcher_variables_is_a_world_of_one():
    """Without RANK/WORLD_SIZE the process is rank 0 of 1 (no separate code path)."""
    env = parse_env({})
    assert (env.rank, env.local_rank, env.world_size) == (0, 0, 1)


def test_torchrun_variables_are_parsed():
    """torchrun's RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT give env:// init."""
    env = parse_env(
        {
            "RANK": "3",
            "LOCAL_RANK": "1",
            "WORLD_SIZE": "4",
            "MASTER_ADDR": "10.0.0.1",
            "MASTER_PORT": "29500",
        }
    )
    assert (env.rank, env.local_rank, env.world_size, env.init_method) == (3, 1, 4, "env://")


def test_spawn_variable_overrides_init_method():
    """spawn's file:// rendezvous variable is used instead of MASTER_ADDR/PORT."""
    env = parse_env({"RANK": "0", "WORLD_SIZE": "2", INIT_METHOD_ENV: "file:///tmp/x"})
    assert env.init_method == "file:///tmp/x"


@pytest.mark.parametrize(
    ("env", "match"),
    [
        ({"RANK": "0"}, "WORLD_SIZE"),
        ({"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "a", "MASTER_PORT": "1"}, "outside"),
        ({"RANK": "x", "WORLD_SIZE": "2"}, "not an integer"),
        ({"RANK": "0", "WORLD_SIZE": "2"}, "MASTER_ADDR"),
        ({"RANK": "0", "WORLD_SIZE": "0"}, ">= 1"),
        (
            {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "a", "MASTER_PORT": "99999"},
            r"MASTER_PORT=99999 is not a TCP port; use one in 1\.\.65535",
        ),
    ],
)
def test_bad_launcher_variables_name_the_fix(env, match):
    """Incomplete or inconsistent launcher variables raise an error naming what is wrong."""
    with pytest.raises(RuntimeError, match=match):
        parse_env(env)


def test_backend_choice():
    """nccl with CUDA, gloo without; nccl without CUDA is refused with the fix."""
    assert resolve_backend(None, cuda_available=True) == "nccl"
    assert resolve_backend(None, cuda_available=False) == "gloo"
    assert resolve_backend("gloo", cuda_available=True) == "gloo"
    with pytest.raises(RuntimeError, match="backend='gloo'"):
        resolve_backend("nccl", cuda_available=False)


def test_local_rank_beyond_visible_gpus_is_refused():
    """LOCAL_RANK >= number of visible GPUs names --nproc_per_node and CUDA_VISIBLE_DEVICES."""
    assert resolve_device("nccl", 1, cuda_count=2) == torch.device("cuda", 1)
    assert resolve_device("gloo", 0, cuda_count=0) == torch.device("cpu")
    with pytest.raises(RuntimeError, match="nproc_per_node <= 2"):
        resolve_device("nccl", 2, cuda_count=2)


def test_world_of_one_runs_collectives(monkeypatch):
    """A plain process gets a real group: collectives are no-op-equivalent at world size 1."""
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", INIT_METHOD_ENV):
        monkeypatch.delenv(key, raising=False)
    info = ddptrain.init_distributed()
    assert (info.rank, info.world_size, info.backend) == (0, 1, "gloo")
    assert ddptrain.is_main()
    assert ddptrain.all_reduce_mean(2.5) == 2.5
    assert ddptrain.all_reduce_mean(2) == 2.0 and isinstance(ddptrain.all_reduce_mean(2), float)
    t = torch.tensor([1.0, 2.0])
    total = ddptrain.all_reduce_sum(t)
    total += 1  # a new tensor, as at any world size: the input is untouched
    assert t.tolist() == [1.0, 2.0] and total.tolist() == [2.0, 3.0]
    ddptrain.shutdown()
    ddptrain.shutdown()


def test_a_world_of_one_writes_no_file_a_killed_run_would_leave(monkeypatch, tmp_path):
    """A plain process's group, its second one included, keeps its store off the disk."""
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", INIT_METHOD_ENV):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    for _ in range(2):
        ddptrain.init_distributed()
        torch.distributed.barrier()
        assert list(tmp_path.iterdir()) == []
        ddptrain.shutdown()


def _run_collectives() -> tuple:
    info = ddptrain.init_distributed()
    mean = ddptrain.all_reduce_mean(float(info.rank))
    total = ddptrain.all_reduce_sum(torch.tensor([info.rank + 1.0]))
    decided = ddptrain.broadcast_object({"stop": info.rank == 0})
    return mean, total.item(), decided


def test_collective_helpers_across_ranks():
    """mean/sum helpers reduce over ranks and broadcast_object sends rank 0's decision."""
    results = ddptrain.spawn(_run_collectives, 3, timeout_s=60)
    assert results == [(1.0, 6.0, {"stop": True})] * 3


def _run_unpaired_on_a_new_group() -> str:
    """Rank 0 all_reduces on a group of ddptrain's alone; rank 1 waits for it on a group that
    torch made with a long timeout."""
    import datetime

    from ddptrain.ddp.hooks import new_group_like

    info = ddptrain.init_distributed(timeout_s=2)
    group = new_group_like(None)
    patient = torch.distributed.new_group(timeout=datetime.timedelta(seconds=60))
    message = ""
    if info.rank == 0:
        try:
            torch.distributed.all_reduce(torch.ones(1), group=group)
            message = "no error"
        except RuntimeError as e:
            message = str(e)
    torch.distributed.barrier(group=patient)
    return message


def test_a_group_ddptrain_makes_times_out_as_the_default_group_does():
    """A new_group_like group's unpaired collective fails after timeout_s, not torch's 30 min."""
    message = ddptrain.spawn(_run_unpaired_on_a_new_group, 2, timeout_s=60)[0]
    assert "timed out" in message.lower(), message


def _collective_threads() -> list[str]:
    """gloo's C++ threads (named in /proc) and ddptrain's Python worker threads, sorted."""
    tasks = os.listdir("/proc/self/task")
    native = [Path(f"/proc/self/task/{t}/comm").read_text().strip() for t in tasks]
    python = [t.name for t in threading.enumerate()]
    return sorted(n for n in native + python if n.startswith(("gloo", "pt_gloo", "ddptrain")))


def _run_shutdown_with_hooks() -> tuple:
    ddptrain.init_distributed()
    model = ddptrain.DDP(torch.nn.Linear(4, 2))
    ring = ddptrain.DDP(torch.nn.Linear(4, 2), comm_hook=named_hook("ring"))
    tcp = ddptrain.DDP(torch.nn.Linear(4, 2), comm_hook=named_hook("tcp"))
    for wrapped in (model, ring, tcp):
        wrapped(torch.randn(3, 4)).sum().backward()
    during = _collective_threads()
    ddptrain.shutdown()
    after = _collective_threads()
    try:
        model(torch.randn(3, 4)).sum().backward()
        refused = ""
    except RuntimeError as e:
        refused = str(e)
    return during, after, refused


def test_shutdown_closes_hook_threads_and_groups_before_exit():
    """shutdown() leaves no hook or gloo thread alive, and a closed hook refuses work."""
    # A gloo thread that outlives shutdown() can abort the interpreter's exit.
    for during, after, refused in ddptrain.spawn(_run_shutdown_with_hooks, 2, timeout_s=60):
        assert "ddptrain-comm" in set(during)
        assert any(n.startswith("pt_gloo") for n in during)
        assert after == []
        assert "closed" in refused


class _Cycle:
    """Garbage only a collection frees: it notes whether the process group still existed."""

    freed_with_group: list[bool] = []

    def __init__(self) -> None:
        self.me = self

    def __del__(self) -> None:
        _Cycle.freed_with_group.append(torch.distributed.is_initialized())


def _run_shutdown_with_garbage() -> list[bool]:
    ddptrain.init_distributed()
    gc.disable()  # only shutdown()'s own collection may free the cycle
    try:
        _Cycle()
        ddptrain.shutdown()
        return list(_Cycle.freed_with_group)
    finally:
        gc.enable()


def test_shutdown_frees_garbage_while_the_groups_still_exist():
    """An object left in a reference cycle is freed by shutdown(), before the groups go."""
    # Freed at exit instead, a wrapper's gloo work outlived its groups and aborted the rank.
    assert ddptrain.spawn(_run_shutdown_with_garbage, 1, timeout_s=60) == [[True]]


def _run_fail_on_rank1() -> None:
    info = ddptrain.init_distributed()
    if info.rank == 1:
        raise ValueError("deliberate failure")
    torch.distributed.barrier()


def test_spawn_propagates_worker_exception_with_rank():
    """A worker's exception reaches the caller with its rank and traceback; no orphan hangs."""
    with pytest.raises(ddptrain.WorkerError, match="rank 1 failed: ValueError: deliberate"):
        ddptrain.spawn(_run_fail_on_rank1, 2, timeout_s=60)


class _LateQueue:
    """A results queue whose item arrives only after the first poll has come back empty."""

    def __init__(self, item: tuple):
        self.items = [None, item]

    def get(self, timeout: float) -> tuple:
        item = self.items.pop(0) if self.items else None
        if item is None:
            raise queue.Empty
        return item


def test_spawn_keeps_a_result_that_lands_after_its_worker_exited():
    """A result queued just before the worker's exit code shows is returned, not called lost."""
    exited = SimpleNamespace(exitcode=0)
    late = _LateQueue((0, True, pickle.dumps("done")))
    assert _collect([exited], late, timeout_s=5) == ["done"]


def test_spawn_reports_a_worker_that_exited_without_a_result():
    """A worker gone with nothing queued is a WorkerError naming its rank and exit code."""
    with pytest.raises(ddptrain.WorkerError, match="rank 0 failed: .*exited with code 3"):
        _collect([SimpleNamespace(exitcode=3)], _LateQueue(None), timeout_s=5)


def _run_sleep() -> None:
    import time

    time.sleep(60)


def test_spawn_times_out_and_kills_workers():
    """A worker that never finishes is killed and reported after timeout_s."""
    with pytest.raises(TimeoutError, match="ranks \\[0\\]"):
        ddptrain.spawn(_run_sleep, 1, timeout_s=3)


def _run_report_process() -> tuple:
    import multiprocessing
    import os

    return os.environ.get("DDPTRAIN_TEST_MARK"), multiprocessing.get_start_method()


@pytest.mark.parametrize("start_method", ["forkserver", "spawn"])
def test_spawn_workers_see_the_callers_environment_now(start_method, monkeypatch):
    """spawn's workers see the caller's current environment and start children the default way."""
    # The forkserver's environment was set earlier; torchrun ranks use the default method too.
    import multiprocessing

    default = multiprocessing.get_context().get_start_method()
    for mark in ("first", "second"):
        monkeypatch.setenv("DDPTRAIN_TEST_MARK", mark)
        results = ddptrain.spawn(_run_report_process, 1, timeout_s=60, start_method=start_method)
        assert results == [(mark, default)]


def _report_folder():
    import os

    from ddptrain.launch.report import REPORT_DIR_ENV

    return os.environ.get(REPORT_DIR_ENV)


def test_spawn_workers_do_not_report_to_the_callers_ddptrain_run(monkeypatch, tmp_path):
    """Ranks spawned by a ddptrain-run worker write nothing to the launcher's report folder."""
    monkeypatch.setenv("DDPTRAIN_REPORT_DIR", str(tmp_path))
    assert ddptrain.spawn(_report_folder, 2, timeout_s=60) == [None, None]


def test_spawn_refuses_an_unknown_start_method():
    """start_method other than forkserver/spawn is a ValueError naming the choices."""
    with pytest.raises(ValueError, match="'forkserver' or 'spawn'"):
        ddptrain.spawn(_run_report_process, 1, start_method="fork")


def test_spawn_refuses_a_function_from_an_interactive_session(monkeypatch):
    """A notebook cell's function is refused before any worker starts; a script's is accepted."""
    # Workers re-run a script's __main__ file; a cell's function has no file to re-run.
    import sys

    def cell_function() -> None:
        pass

    cell_function.__module__ = "__main__"
    main = sys.modules["__main__"]
    monkeypatch.delattr(main, "__file__", raising=False)
    started = []
    monkeypatch.setattr(ddptrain.launch.spawn, "_context", lambda method: started.append(method))
    with pytest.raises(ValueError, match="cell_function is defined in an interactive session"):
        ddptrain.spawn(cell_function, 2)
    assert started == []
    monkeypatch.setattr(main, "__file__", __file__, raising=False)
    ddptrain.launch.spawn._check_importable(cell_function)  # a script: accepted
    ddptrain.launch.spawn._check_importable(_run_sleep)  # a module's function: accepted
