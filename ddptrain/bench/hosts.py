"""The step bench across two hosts made inside this machine: gloo over TCP, no shared memory.

    python -m ddptrain.bench --two-hosts --extras none          # root; world size 2, minutes
    python -m ddptrain.bench --two-hosts --quick --out bench-results/two-hosts   # seconds
    python -m ddptrain.bench --two-hosts --ranks-per-host 2     # world size 4
    python -m ddptrain.bench --two-hosts --link 1gbit           # over a 1 Gbit/s link

Makes two fake hosts (ddptrain.netns: network namespaces joined by a veth pair, every command
with a /dev/shm of its own, so the wrapper cannot reduce in shared memory and uses the
backend's all_reduce over the veth, as between real hosts), starts one torchrun per host that
runs `python -m ddptrain.bench` with the other flags, and waits up to --timeout-s. On a
failure or timeout both launchers are killed with every process they started; the namespaces
are deleted whatever happens. Rank 0, on host a, writes into a scratch folder inside <out>;
only a run that succeeds moves bench.json (and bench.png) out of it, so a failed or timed-out
run never leaves a result behind. The JSON's settings name both hosts, say
"bucket_transport": "backend", and describe the link ("two_hosts"). Needs root and iproute2;
says so otherwise.

--link RATE (tc's form: 100mbit, 1gbit, 10gbit) shapes both directions of the veth with tc tbf
(bench/link.py) and first measures one plain TCP stream and a 1-byte round trip over it,
printed and kept in the JSON; the defaults then become the question a slow link asks: the MLP,
`--extras bf16,fp16,powersgd,torch-powersgd,torch-ddp-powersgd` (bench/compression.py), an
8 MiB all_reduce 3 times, and a chart of samples/s per variant (flags given still win).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ddptrain.bench import compression, link, steps
from ddptrain.bench.report import plot_throughput
from ddptrain.netns import Host, kill_tree, torchrun, two_hosts

_POLL_S = 0.2
_LOG_TAIL_CHARS = 4000
# What --link runs unless told otherwise: the communication-heavy model and the compressions.
SLOW_LINK_DEFAULTS = [
    *("--models", "mlp", "--extras", ",".join(["bf16", "fp16", *compression.EXTRAS])),
    *("--ring-sizes", "8", "--ring-reps", "3"),
]


class RunFailed(RuntimeError):
    """A launcher failed or the run timed out; carries the end of both launchers' output."""


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str], argparse.Namespace]:
    """(runner options, the bench's own flags, those flags parsed); bad flags exit as usual."""
    p = argparse.ArgumentParser(
        prog="python -m ddptrain.bench --two-hosts",
        description=__doc__.split("\n")[0],
        epilog="Every other flag is the step bench's (python -m ddptrain.bench --help).",
    )
    p.add_argument("--two-hosts", action="store_true", required=True)
    p.add_argument("--ranks-per-host", type=int, default=1, help="torchrun's --nproc_per_node")
    p.add_argument(
        "--link",
        default=None,
        metavar="RATE",
        help="shape the veth to RATE (100mbit, 1gbit, 10gbit, ...) with tc tbf; default: "
        "unshaped (memory speed)",
    )
    runner, bench_argv = p.parse_known_args(argv)
    if runner.ranks_per_host < 1:
        p.error(f"--ranks-per-host must be >= 1, got {runner.ranks_per_host}")
    if runner.link is not None:
        try:
            link.rate_bits(runner.link)
        except ValueError as e:
            p.error(str(e))
        # Defaults first: the flags given come later and win.
        bench_argv = [*SLOW_LINK_DEFAULTS, *bench_argv]
    bench = steps.parse_args(bench_argv)
    if bench.world_size is not None:
        p.error("--world-size does not apply: the world is 2 x --ranks-per-host")
    return runner, bench_argv, bench


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the step bench on two fake hosts; return the result rank 0 wrote to bench.json."""
    runner, bench_argv, bench = parse_args(list(sys.argv[1:] if argv is None else argv))
    out = bench.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    # Ranks can be killed halfway through writing; the result reaches <out> only from here.
    scratch = Path(tempfile.mkdtemp(prefix=".two-hosts-", dir=out))
    try:
        return _run_and_publish(runner, bench_argv, bench, scratch, out)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _run_and_publish(
    runner: argparse.Namespace,
    bench_argv: list[str],
    bench: argparse.Namespace,
    scratch: Path,
    out: Path,
) -> dict[str, Any]:
    # The later --out wins: rank 0 writes where this process expects, whatever its cwd.
    module_args = ["-m", "ddptrain.bench", *bench_argv, "--out", str(scratch)]
    with terminate_as_exit(), two_hosts("ddpb") as (a, b):
        shaping = link.shape_link(a, b, runner.link) if runner.link is not None else None
        if shaping is not None:
            print(link.describe(shaping), flush=True)
        rdzv_id = f"ddptrain-bench-{os.getpid()}"
        commands = [
            torchrun(
                host,
                a,
                nnodes=2,
                nproc_per_node=runner.ranks_per_host,
                rdzv_id=rdzv_id,
                args=module_args,
            )
            for host in (a, b)
        ]
        envs = [host.env(OMP_NUM_THREADS=str(bench.threads)) for host in (a, b)]
        output = run_launchers(commands, envs, bench.timeout_s)
    # Rank 0 printed paths inside the scratch folder; name the ones the files end up at.
    print(output.replace(str(scratch), str(out)), end="", flush=True)
    result = json.loads((scratch / "bench.json").read_text())
    result["settings"]["two_hosts"] = _link(a, b, runner.ranks_per_host, shaping)
    (out / "bench.json").write_text(json.dumps(result, indent=1))
    if shaping is not None and not bench.no_plot:
        if plot_throughput(result, out / "bench.png", f"two hosts, link shaped to {runner.link}"):
            print(f"wrote {out / 'bench.png'}: samples/s per variant")
    elif (scratch / "bench.png").exists():
        (scratch / "bench.png").replace(out / "bench.png")
    return result


def _link(a: Host, b: Host, ranks_per_host: int, shaping: dict[str, Any] | None) -> dict[str, Any]:
    return {
        "link": "veth pair between two network namespaces on one machine",
        "hosts": [{"netns": h.netns, "ifname": h.ifname, "addr": h.addr} for h in (a, b)],
        "ranks_per_host": ranks_per_host,
        "private_dev_shm": True,
        "shaping": shaping,
    }


def run_launchers(commands: list[list[str]], envs: list[dict[str, str]], timeout_s: float) -> str:
    """Run the launchers together; the first one's output, or RunFailed with both outputs."""
    with tempfile.TemporaryDirectory(prefix="ddptrain-two-hosts-") as logs:
        paths = [Path(logs) / f"host-{name}.log" for name in "ab"[: len(commands)]]
        procs = []
        codes: list[int | None] = [None] * len(commands)
        try:
            for command, env, path in zip(commands, envs, paths, strict=True):
                with path.open("w") as log:
                    procs.append(
                        subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
                    )
            deadline = time.monotonic() + timeout_s
            while True:
                codes = [proc.poll() for proc in procs]
                # One launcher failing leaves the other waiting for its peers until a timeout:
                # stop both at once.
                if all(c == 0 for c in codes) or any(c not in (None, 0) for c in codes):
                    break
                if time.monotonic() > deadline:
                    break
                time.sleep(_POLL_S)
        finally:
            for proc in procs:
                if proc.poll() is None:
                    kill_tree(proc)
        outputs = [path.read_text() for path in paths]
    if codes != [0] * len(commands):
        # A launcher still running when another failed was stopped, not timed out.
        failed = any(c not in (None, 0) for c in codes)
        why = "failed" if failed else f"timed out after {timeout_s:.0f} s"
        tails = "\n".join(
            f"--- host {name}: {' '.join(c)}\n{o[-_LOG_TAIL_CHARS:]}"
            for name, c, o in zip("ab", commands, outputs, strict=False)
        )
        raise RunFailed(f"two-host bench {why} (launcher exit codes {codes})\n{tails}")
    return outputs[0]


@contextmanager
def terminate_as_exit() -> Iterator[None]:
    """SIGTERM raises SystemExit inside, so the namespaces and launchers are cleaned up."""

    # SIGTERM (a job scheduler's, `timeout`'s) would kill this process without unwinding, and
    # leave the namespaces and both launchers behind; as SystemExit, cleanup runs.
    def on_term(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    try:
        previous = signal.signal(signal.SIGTERM, on_term)
    except ValueError:  # not the main thread: leave SIGTERM alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
