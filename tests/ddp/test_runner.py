"""OrderedRunner: one job at a time, in order; jobs left to their waiter run on its thread."""

import threading
import time

import pytest

from ddptrain.ddp.hooks import OrderedRunner

# Long enough for an idle worker to pick up a job on a loaded machine; a stuck one still fails.
WORKER_TIMEOUT_S = 30.0


def _until_done(job) -> None:
    deadline = time.monotonic() + WORKER_TIMEOUT_S
    while not job.done:
        assert time.monotonic() < deadline, "the worker never ran the job"
        time.sleep(0.001)


def test_the_worker_runs_woken_jobs_in_order_and_errors_reach_the_waiter():
    """Jobs submitted normally run on the worker, one at a time, in submission order."""
    runner = OrderedRunner()
    seen: list[tuple[int, str]] = []
    try:
        jobs = [
            runner.submit(lambda i=i: seen.append((i, threading.current_thread().name)) or i)
            for i in range(5)
        ]
        failing = runner.submit(lambda: 1 / 0)
        _until_done(failing)  # nobody waits: the worker ran them all
        assert seen == [(i, "ddptrain-runner") for i in range(5)]
        assert [job.wait() for job in jobs] == list(range(5))
        with pytest.raises(ZeroDivisionError):
            failing.wait()
    finally:
        runner.close()


def test_jobs_left_to_the_waiter_run_on_its_thread_after_those_before():
    """wake=False: the worker leaves the job; the waiter runs it, and unstarted ones ahead."""
    runner = OrderedRunner()
    order: list[str] = []

    def note(name: str) -> str:
        order.append(name)
        return threading.current_thread().name

    try:
        first = runner.submit(note, "first", wake=False)
        second = runner.submit(note, "second", wake=False)
        time.sleep(0.05)  # an idle worker that took them would have run them by now
        assert not first.done and not second.done
        here = threading.current_thread().name
        assert second.wait() == here and first.wait() == here
        assert order == ["first", "second"]
    finally:
        runner.close()


def test_close_cancels_what_has_not_started_and_stops_the_worker():
    """close() runs nothing more: queued jobs fail when waited for, new ones are refused."""
    runner = OrderedRunner()
    done: list[int] = []
    left = runner.submit(done.append, 1, wake=False)
    runner.close()
    assert done == [] and not runner._thread.is_alive()
    with pytest.raises(RuntimeError, match="cancelled"):
        left.wait()
    with pytest.raises(RuntimeError, match="closed"):
        runner.submit(done.append, 2)


def test_close_waits_a_bounded_time_for_a_running_job():
    """A job that never ends (a peer that never comes) does not hang close()."""
    runner = OrderedRunner()
    release = threading.Event()
    started = threading.Event()
    stuck = runner.submit(lambda: started.set() or release.wait())
    assert started.wait(WORKER_TIMEOUT_S)
    runner.close(timeout_s=0.2)
    assert runner._thread.is_alive() and not stuck.done
    release.set()
    runner._thread.join(WORKER_TIMEOUT_S)
    assert stuck.done and not runner._thread.is_alive()
