"""`python -m ddptrain.plan`: predicted step time and memory per rank; --check runs them too.

    python -m ddptrain.plan --model mlp                          # this machine, 1-4 ranks
    python -m ddptrain.plan --model mlp --link 1gbit --world-sizes 2,4,8,16
    python -m ddptrain.plan --model mlp --link nccl-100g --world-sizes 8,64,512   # GPU ranks
    python -m ddptrain.plan --models lenet,mlp --links local,100mbit,1gbit,10gbit \\
        --world-sizes 2,3,4 --check --out plan-results          # predicted vs measured (root)
    python -m ddptrain.plan --device cuda --models mlp,lenet,gpt --strategies ddp,zero1,zero3 \\
        --world-sizes 1 --check --out plan-cuda                 # one GPU: predicted vs measured

Per model and link: a table per strategy and world size (step time, samples/s, scaling
efficiency against one rank, exposed communication, peak memory, whether it fits), the
strategy it would pick at each world size and the largest world size keeping efficiency >=
80%. --check trains each setup for real where this machine can (one host: ranks spawned here;
a rate: two network namespaces, one rank each, the link shaped with tc, root only) and prints
predicted against measured. Writes <out>/plan.json (--json: also on stdout, per configuration
the predicted step seconds and peak bytes, and the measured ones after --check) and a chart per
model and link (PNG with matplotlib, else text). --device cuda (the default where torch sees a
GPU) profiles and checks on the GPU, in device seconds and device memory, planning for a GPU
link (nccl-100g unless told); --check runs at most as many ranks as there are GPUs.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from ddptrain.bench.report import machine
from ddptrain.plan import DEFAULT_LINKS, DEFAULT_STRATEGIES, plan, resolve_link
from ddptrain.plan.check import (
    beyond_gpus,
    combine,
    compare,
    run_local,
    run_twice_at_most,
    run_two_hosts,
    wait_for_quiet,
)
from ddptrain.plan.links import NAMED, BusLink, LocalLink, ShapedLink
from ddptrain.plan.meter import DEVICES
from ddptrain.plan.predict import predict
from ddptrain.plan.report import (
    format_check,
    format_choice,
    format_picks,
    format_table,
    plot,
    text_chart,
)
from ddptrain.plan.rounds import turns
from ddptrain.plan.run import Steps
from ddptrain.plan.setup import (
    OPTIMIZERS,
    PRECISIONS,
    STRATEGIES,
    Setup,
    default_device,
    require_device,
)
from ddptrain.plan.workloads import names


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(prog="python -m ddptrain.plan", description=__doc__.split("\n")[0])
    p.add_argument("--models", "--model", default="mlp",
                   help=f"comma-separated: {', '.join(names())}, or module:factory")  # fmt: skip
    p.add_argument("--strategies", default=",".join(DEFAULT_STRATEGIES),
                   help=f"comma-separated, of {', '.join(STRATEGIES)}")  # fmt: skip
    p.add_argument("--world-sizes", default="1,2,3,4", help="comma-separated")
    p.add_argument("--links", "--link", default=None,
                   help="comma-separated: local (this machine, shared memory); a rate as tc "
                   "writes it (100mbit, 1gbit, 10gbit: two hosts on this machine); "
                   f"{', '.join(NAMED)} (GPU ranks, NCCL). Default: "
                   f"{DEFAULT_LINKS['cpu']} on cpu, {DEFAULT_LINKS['cuda']} on cuda")  # fmt: skip
    p.add_argument("--device", choices=list(DEVICES), default=None,
                   help="where the profile and --check run: cuda (device seconds and memory, "
                   "NCCL, one GPU per rank) or cpu (CPU seconds, RSS, gloo). Default: cuda when "
                   "torch.cuda.is_available(), else cpu")  # fmt: skip
    p.add_argument("--batch-size", type=int, default=None, help="per rank (default: the model's)")
    p.add_argument("--precision", default="fp32", choices=list(PRECISIONS))
    p.add_argument("--optimizer", default="sgd", choices=list(OPTIMIZERS))
    p.add_argument("--powersgd-rank", type=int, default=4)
    p.add_argument("--background", type=float, default=None,
                   help="busy threads of other programs to plan for (default: counted now; "
                   "0: an idle machine)")  # fmt: skip
    p.add_argument("--memory-per-rank-gib", type=float, default=None,
                   help="what fits (default: this machine's memory / its ranks)")  # fmt: skip
    p.add_argument("--check", action="store_true", help="run each setup for real and compare")
    p.add_argument("--quiet-below", type=float, default=None,
                   help="--check: wait until at most this many busy threads of other programs "
                   "before each run (up to --quiet-wait-s)")  # fmt: skip
    p.add_argument("--quiet-wait-s", type=float, default=120.0)
    p.add_argument("--steps", default="3,6,2",
                   help="--check: warm-up steps, blocks, least steps a block")  # fmt: skip
    p.add_argument("--block-s", type=float, default=Steps.block_s,
                   help="--check: more steps a block, as many as fill these seconds")  # fmt: skip
    p.add_argument("--rounds", type=int, default=1,
                   help="profiles of each strategy and --check's runs of each configuration, "
                   "the strategies taking turns, the order reversed each round; profiles "
                   "merged, blocks pooled")  # fmt: skip
    p.add_argument("--out", type=Path, default=Path("plan-results"))
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--json", action="store_true",
                   help="print plan.json on stdout (tables to stderr)")  # fmt: skip
    args = p.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    args.strategies = [s for s in args.strategies.split(",") if s]
    args.world_sizes = _ints(args.world_sizes)
    bad = [s for s in args.strategies if s not in STRATEGIES]
    if bad:
        p.error(f"unknown strategies {bad}: choose from {', '.join(STRATEGIES)}")
    if not args.world_sizes or min(args.world_sizes) < 1:
        p.error("--world-sizes: positive integers, e.g. 1,2,4")
    args.device = args.device or default_device()
    args.links = [x for x in (args.links or DEFAULT_LINKS[args.device]).split(",") if x]
    try:
        require_device(args.device)
        if args.device == "cuda":
            _refuse_for_cuda(args)
    except ValueError as e:
        raise SystemExit(f"{p.prog}: error: {e}") from None
    if args.rounds < 1:
        p.error("--rounds: at least 1")
    warmup, blocks, block = _ints(args.steps)
    args.steps = Steps(warmup, blocks, block, args.block_s)
    return args


def _refuse_for_cuda(args: argparse.Namespace) -> None:
    """CUDA ranks plan on GPU links, and --check runs one rank per GPU."""
    cpu_links = [x for x in args.links if x not in NAMED]
    if cpu_links:
        raise ValueError(
            f"--links {','.join(cpu_links)}: CPU links; with --device cuda give one of "
            f"{', '.join(NAMED)}"
        )
    if args.check:
        import torch

        gpus = torch.cuda.device_count()
        over = beyond_gpus(args.world_sizes, gpus)
        if over:
            raise ValueError(
                f"--check on cuda runs one rank per GPU with NCCL: world sizes "
                f"{','.join(map(str, over))} need more than the {gpus} GPU(s) here; drop them "
                "from --world-sizes, or plan them without --check"
            )


def _checkable(link: Any, world_size: int, device: str) -> bool:
    if device == "cuda":
        return isinstance(link, BusLink)
    if isinstance(link, LocalLink):
        return world_size <= 4 * link.cores
    return isinstance(link, ShapedLink) and world_size == 2


def _check(args: argparse.Namespace, result: Any, link: Any) -> list[dict[str, Any]]:
    # World size outermost, strategies next: the runs a pick compares are side by side in
    # time, and each round runs them in the other order, so a slow spell of the machine
    # falls on all of them rather than on one.
    rows = []
    for n in args.world_sizes:
        todo = [
            (Setup(**pred.setup), prof)
            for pred, prof in zip(result.predictions, result.profiles, strict=True)
            if _checkable(link, n, pred.setup["device"])
        ]
        runs: list[list[dict[str, Any]]] = [[] for _ in todo]
        busy: list[list[float]] = [[] for _ in todo]
        for i in turns(len(todo), args.rounds):
            setup = todo[i][0]
            busy[i].append(_background(args, link))
            if isinstance(link, ShapedLink):
                run = functools.partial(run_two_hosts, setup, link.name, args.steps)
            else:
                run = functools.partial(run_local, setup, n, args.steps)
            runs[i].append(run_twice_at_most(run, f"{setup.label} ws{n} {link.name}"))
        for (setup, prof), measured, counts in zip(todo, runs, busy, strict=True):
            mean_busy = statistics.fmean(counts)
            point = predict(setup, prof, link, [n], background=mean_busy).points[0]
            rows.append(compare(setup, point, combine(measured), link.name, mean_busy))
            print(format_check(rows[-1:]).splitlines()[1], flush=True)
    return rows


def _background(args: argparse.Namespace, link: Any) -> float:
    """Busy threads of other programs to plan a run for: none beside GPUs, the number given,
    or those counted now (after waiting for quiet, if asked)."""
    if isinstance(link, BusLink):
        return 0.0
    if args.background is not None:
        return args.background
    return wait_for_quiet(args.quiet_below, args.quiet_wait_s)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Predict (and check) every model on every link; print, write plan.json and charts."""
    args = parse_args(argv)
    if not args.json:
        return _main(args)
    with contextlib.redirect_stdout(sys.stderr):
        out = _main(args)
    print(json.dumps(out, indent=1, default=str))
    return out


def _main(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {"settings": _settings(args), "plans": [], "check": []}
    args.out.mkdir(parents=True, exist_ok=True)
    budget = int(args.memory_per_rank_gib * 2**30) if args.memory_per_rank_gib else None
    for model in args.models:
        for link_name in args.links:
            link = resolve_link(link_name, args.world_sizes, args.device)
            result = plan(
                model,
                strategies=args.strategies,
                world_sizes=args.world_sizes,
                link=link,
                batch_size=args.batch_size,
                precision=args.precision,
                optimizer=args.optimizer,
                powersgd_rank=args.powersgd_rank,
                background=args.background,
                memory_per_rank_bytes=budget,
                device=args.device,
                profile_rounds=args.rounds,
            )
            title = f"{model}, {link_name}: {getattr(link, 'description', '')}"
            print(f"\n== {title} (planned for {result.background_threads:.1f} busy threads of "
                  "other programs)")  # fmt: skip
            print(format_table(result.predictions))
            print(format_choice(result.predictions, result.world_sizes))
            print(text_chart(result.predictions))
            rows = _check(args, result, link) if args.check else []
            if rows:
                print(format_check(rows))
            out["plans"].append({"model": model, **result.as_dict()})
            out["check"] += rows
            chart = args.out / f"plan-{model.replace(':', '-')}-{link_name}.png"
            if not args.no_plot and plot(result.predictions, rows, chart, title):
                print(f"wrote {chart}")
    if out["check"]:
        print("\n== predicted against measured, every configuration run")
        print(format_check(out["check"]))
        print(format_picks(out["check"]))
    out["settings"]["load_avg_1m_after"] = os.getloadavg()[0]
    (args.out / "plan.json").write_text(json.dumps(out, indent=1, default=str))
    print(f"wrote {args.out / 'plan.json'}")
    return out


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "command": "python -m ddptrain.plan " + " ".join(sys.argv[1:]),
        "machine": machine(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "load_avg_1m_before": os.getloadavg()[0],
        "steps": {
            "warmup": args.steps.warmup,
            "blocks": args.steps.blocks,
            "block": args.steps.block,
            "block_s": args.steps.block_s,
        },  # fmt: skip
        "rounds": args.rounds,
        "malloc": "glibc returns freed blocks at once (mmap threshold 64 KiB, one arena)",
        "models": args.models,
        "strategies": args.strategies,
        "world_sizes": args.world_sizes,
        "links": args.links,
        "device": args.device,
        "batch_size": args.batch_size,
        "precision": args.precision,
        "optimizer": args.optimizer,
        "powersgd_rank": args.powersgd_rank,
    }


if __name__ == "__main__":
    main()
