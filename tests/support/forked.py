"""`python script.py ARGS` or `python -c CODE ARGS` as a process forked from a server that has
imported torch and ddptrain: a rank of its own, without paying the torch import (2-3 s on a
2-core machine) each time a test starts one.

    proc = forked.popen([str(JOB), "--fault", "kill:2:5"], env=env, cwd=tmp_path)
    proc.poll(); proc.wait(timeout=60); proc.kill(); proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=60)        # stdout and stderr together, as text
    done = forked.run(["-c", CODE, "arg"], env=env, timeout=60)   # .returncode, .stdout

The child sets the environment, working directory, sys.argv and sys.path as the interpreter
would, then runs the script as __main__; its exit status is the script's (SystemExit's code, 1
for an exception, -N for a signal N), as with subprocess. What it cannot do like a fresh
interpreter: settings torch reads once at import come from the server (the ranks set their
thread count from OMP_NUM_THREADS instead), modules the server imported are not imported again,
and atexit handlers do not run (multiprocessing ends its children with os._exit). Tests that
check an interpreter's start, or torch's import, start real ones.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from ddptrain.launch.spawn import PRELOAD

_POLL_S = 0.02


def _child(argv: list[str], env: dict[str, str], cwd: str, out_path: str) -> None:
    out = os.open(out_path, os.O_WRONLY | os.O_APPEND)
    os.unlink(out_path)  # the parent reads it through the handle it opened before the start
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    if "OMP_NUM_THREADS" in env:
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    # As in an interpreter started from a terminal, whatever the server inherited (a suite run
    # as a background job ignores SIGINT): SIGINT is a KeyboardInterrupt.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        if argv[0] == "-c":
            sys.argv = ["-c", *argv[2:]]
            sys.path[0] = ""
            exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__"})
        else:
            sys.argv = list(argv)
            sys.path[0] = str(Path(argv[0]).resolve().parent)
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit:
        raise  # multiprocessing maps its code as the interpreter does
    except BaseException:
        # As the interpreter reports it, not as multiprocessing does ("Process ...:" first).
        traceback.print_exc()
        raise SystemExit(1) from None


class _Output:
    """The child's stdout and stderr, read from the file they go to."""

    def __init__(self, path: str, process: mp.process.BaseProcess):
        self._file = open(path, encoding="utf-8", errors="replace")
        # The process, not the ForkedProcess: no reference cycle, so the file closes as soon as
        # the test drops it, never inside a later test's warnings.catch_warnings.
        self._process = process

    def readline(self) -> str:
        """The next whole line, waiting for it while the child runs ("" once it has ended)."""
        line = ""
        while not line.endswith("\n"):
            if self._process.exitcode is not None:
                return line + self._file.readline()  # all it wrote is in the file now
            line += self._file.readline()
            time.sleep(_POLL_S)
        return line

    def read(self) -> str:
        return self._file.read()

    def __del__(self) -> None:
        self._file.close()


class ForkedProcess:
    """The subprocess.Popen methods the tests use, for a child of the preloaded server."""

    def __init__(self, argv: list[str], env: dict[str, str] | None, cwd: str | Path | None):
        if "forkserver" in mp.get_all_start_methods():
            ctx = mp.get_context("forkserver")
            # ddptrain.spawn's list: whichever of the two starts the server sets it.
            ctx.set_forkserver_preload(PRELOAD)
        else:  # a fresh interpreter, as subprocess would start
            ctx = mp.get_context("spawn")
        fd, self._out_path = tempfile.mkstemp(prefix="ddptrain-forked-", suffix=".out")
        os.close(fd)
        self._process = ctx.Process(
            target=_child,
            args=(list(argv), dict(os.environ if env is None else env), str(cwd or os.getcwd())),
            kwargs={"out_path": self._out_path},
        )
        self.stdout = _Output(self._out_path, self._process)
        self._process.start()
        self.pid = self._process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(["forked", self.pid], timeout)
        return self._process.exitcode

    def communicate(self, timeout: float | None = None) -> tuple[str, None]:
        self.wait(timeout)
        return self.stdout.read(), None

    def send_signal(self, sig: int) -> None:
        if self._process.exitcode is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def __del__(self) -> None:
        try:  # a child that ended before it opened the file left it behind
            os.unlink(self._out_path)
        except OSError:
            pass


def popen(
    argv: list[str], env: dict[str, str] | None = None, cwd: str | Path | None = None
) -> ForkedProcess:
    """Start `argv` (a script and its arguments, or "-c", code and arguments) as a child of
    the preloaded server; its stdout and stderr go to `.stdout`, together."""
    return ForkedProcess(argv, env, cwd)


def run(
    argv: list[str],
    env: dict[str, str] | None = None,
    cwd: str | Path | None = None,
    timeout: float | None = None,
) -> subprocess.CompletedProcess:
    """popen, then wait for it (killed after `timeout`, raising TimeoutExpired)."""
    proc = popen(argv, env, cwd)
    try:
        out, _ = proc.communicate(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise
    return subprocess.CompletedProcess(argv, proc.returncode, out, "")
