"""Past this machine, on paper: GPU ranks at 8 to 1024 over 25, 100 and 400 Gbit/s links.

    python -m ddptrain.plan.scaling --out docs/scaling.md     # regenerate the page
    spec = gpt2_small(); prof = paper_profile(spec, batch_size=16)
    predict(Setup(strategy="ddp"), prof, named_link("nccl-100g"), [8, 64, 1024])

A model on paper is its parameters and its layers in forward order, each with the FLOPs and
the activation bytes one sample costs it (`Spec`). `paper_profile` turns one into the Profile a
one-process run would have measured on a GPU that sustains DEVICE_FLOPS: forward FLOPs / that
rate, backward twice the forward, layer by layer in reverse, each parameter's gradient ready
when the last layer that uses it has run its backward (a tied embedding: at the very end),
buckets as the DDP wrapper assigns them (25 MiB, a 1 MiB first), the optimizer a pass over its
tensors at HBM_BYTES_PER_S, every layer a unit of the sharded wrapper. Then predict.py models
the ranks as it does on this machine, with a GPU link (links.NAMED): no CPU contention.
Parameters, gradients and AdamW's state are float32 (as under torch autocast); the peak is
tensors only: no CUDA context, no allocator slack.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ddptrain.ddp.buckets import assign_buckets
from ddptrain.plan.links import NAMED, named_link
from ddptrain.plan.predict import (
    NEAR,
    Prediction,
    largest_efficient,
    pick,
    predict,
    set_efficiency,
)
from ddptrain.plan.profile import Profile
from ddptrain.plan.steps import plain_memory_ops
from ddptrain.plan.timeline import simulate

# Sustained: about 40% of an H100 SXM's 989 dense bf16 TFLOP/s (NVIDIA H100 datasheet), the
# model FLOPs utilization large training runs report; an assumption, not a measurement.
DEVICE_FLOPS = 400e12
# H100 SXM HBM3 bandwidth (NVIDIA H100 datasheet): the optimizer step is a pass over memory.
HBM_BYTES_PER_S = 3.35e12
DEVICE_MEMORY_BYTES = 80 * 2**30
# AdamW reads parameter, gradient and two moments, writes parameter and moments (float32).
ADAMW_BYTES_PER_PARAM = 28
LINKS = ("nccl-25g", "nccl-100g", "nccl-400g")
WORLD_SIZES = (8, 16, 32, 64, 128, 256, 512, 1024)
STRATEGIES = ("ddp", "zero1", "zero3", "powersgd")


@dataclass
class Layer:
    """Parameters a layer uses (indices), its forward FLOPs and saved bytes per sample."""

    params: list[int]
    flops: float
    activation_bytes: float


@dataclass
class Spec:
    """A model on paper: parameter shapes in registration order, layers in forward order."""

    name: str
    shapes: list[tuple[int, ...]]
    layers: list[Layer] = field(default_factory=list)
    batch_size: int = 32
    note: str = ""

    @property
    def numel(self) -> int:
        return sum(_numel(s) for s in self.shapes)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def mlp() -> Spec:
    """ddptrain's MLP (ddptrain.models.MLP), float32, per-rank batch 32 as in the benches."""
    from ddptrain.models import MLP

    with torch.device("meta"):
        model = MLP()
    spec = Spec("mlp", [], batch_size=32, note="ddptrain.models.MLP, 28x28 inputs")
    for linear in [*model.hidden, model.out]:
        out_f, in_f = linear.weight.shape
        first = len(spec.shapes)
        spec.shapes += [(out_f, in_f), (out_f,)]
        # A Linear saves its input; the ReLU after it its output (float32).
        spec.layers.append(Layer([first, first + 1], 2.0 * in_f * out_f, 4.0 * (in_f + out_f)))
    return spec


def gpt2_small(seq: int = 1024, batch_size: int = 16) -> Spec:
    """GPT-2 small (124M): 12 blocks of width 768, 12 heads, vocabulary 50257, context 1024,
    the output projection tied to the token embedding."""
    vocab, d, n_layer, heads = 50257, 768, 12, 12
    shapes: list[tuple[int, ...]] = [(vocab, d), (seq, d)]
    layers = [Layer([0, 1], 0.0, 2.0 * seq * d)]
    for _ in range(n_layer):
        first = len(shapes)
        shapes += [(d,), (d,), (3 * d, d), (3 * d,), (d, d), (d,)]
        shapes += [(d,), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,)]
        matmul = 3 * d * d + d * d + 8 * d * d
        # Kaplan et al. 2020: 2N + 2 n_ctx d per token forward for a block; Korthikanti et al.
        # 2022: s h (34 + 5 a s / h) bytes of 16-bit activations a block saves per sequence.
        flops = seq * (2.0 * matmul + 2.0 * seq * d)
        saved = seq * d * (34 + 5 * heads * seq / d)
        layers.append(Layer(list(range(first, first + 12)), flops, saved))
    final = len(shapes)
    shapes += [(d,), (d,)]
    # The tied output projection: bf16 logits and their float32 copy for the loss.
    layers.append(Layer([final, final + 1, 0], seq * 2.0 * d * vocab, seq * vocab * 6.0))
    note = f"GPT-2 small shape, {seq}-token sequences, tied embedding"
    return Spec("gpt2-small", shapes, layers, batch_size, note)


def paper_profile(spec: Spec, batch_size: int | None = None) -> Profile:
    """The Profile of `spec` on one GPU (module docstring)."""
    b = batch_size or spec.batch_size
    numels = [_numel(s) for s in spec.shapes]
    forward = [layer.flops * b / DEVICE_FLOPS for layer in spec.layers]
    forward_s = sum(forward)
    spans, at = [], 0.0
    for t in forward:
        spans.append([at, at + t])
        at += t
    # Backward: layers in reverse, each twice its forward; a parameter is ready when the last
    # layer (in backward order) that uses it is done.
    ready = [0.0] * len(numels)
    at = 0.0
    for layer, t in reversed(list(zip(spec.layers, forward, strict=True))):
        at += 2 * t
        for i in layer.params:
            ready[i] = at
    backward_s = at
    order = list(reversed(range(len(numels))))
    groups = assign_buckets([numels[i] * 4 for i in order], ["f32"] * len(order),
                            25 * 2**20, 2**20)  # fmt: skip
    buckets = [[order[j] for j in g] for g in groups]
    units = _units(spec)
    acts = [layer.activation_bytes * b for layer in spec.layers]
    param_bytes, state = 4 * sum(numels), 8 * sum(numels)
    prof = Profile(
        setup={"model": spec.name, "batch_size": b},
        param_names=[f"p{i}" for i in range(len(numels))],
        param_numels=numels,
        param_shapes=[list(s) for s in spec.shapes],
        element_bytes=4,
        step_s=3 * forward_s,
        wall_step_s=3 * forward_s,
        forward_s=forward_s,
        backward_s=backward_s,
        optimizer_s=ADAMW_BYTES_PER_PARAM * sum(numels) / HBM_BYTES_PER_S,
        ready_s=ready,
        buckets=buckets,
        bucket_ready_s=[max(ready[i] for i in bucket) for bucket in buckets],
        hook_s=[0.0] * len(buckets),
        units=[members for members, _ in units],
        unit_forward_s=[[0.0, forward_s]] + [spans[k] for _, k in units[1:]],
        activation_bytes=int(sum(acts)),
        unit_activation_bytes=[int(acts[0] + acts[-1])] + [int(acts[k]) for _, k in units[1:]],
        optimizer_state_bytes=state,
    )
    # The peak of the plain step: parameters, AdamW's state and the step's tensors at their most.
    prof.peak_rss_bytes = param_bytes + state + simulate(plain_memory_ops(prof), None).peak_bytes
    return prof


def _units(spec: Spec) -> list[tuple[list[int], int]]:
    """(parameters, layer) per unit: the root (first and last layer, whose parameters a tied
    embedding shares) then every layer between."""
    inner = list(range(1, len(spec.layers) - 1))
    root = sorted({i for k in (0, len(spec.layers) - 1) for i in spec.layers[k].params})
    return [(root, 0)] + [(spec.layers[k].params, k) for k in inner]


def plans(spec: Spec) -> dict[str, list[Prediction]]:
    """Per GPU link, every strategy's predictions at one rank and at WORLD_SIZES, efficiency
    against the fastest one-rank step, fits against DEVICE_MEMORY_BYTES."""
    from ddptrain.plan.setup import Setup

    prof = paper_profile(spec)
    out = {}
    for name in LINKS:
        preds = []
        for strategy in STRATEGIES:
            pred = predict(Setup(strategy=strategy), prof, named_link(name), [1, *WORLD_SIZES])
            for p in pred.points:
                p.fits = p.peak_bytes <= DEVICE_MEMORY_BYTES
            preds.append(pred)
        set_efficiency(preds, min(p.at(1).step_s for p in preds))
        out[name] = preds
    return out


def _verdict(preds: list[Prediction]) -> str:
    best = largest_efficient(preds, list(WORLD_SIZES))
    return f"{best[0]} ({best[1].setup['strategy']})" if best else "none from 8"


def headline(specs: list[Spec]) -> str:
    """One row per model and link: DDP's efficiency at 8, 64 and 1024 ranks, and the largest
    world size whose pick keeps 80%."""
    rows = [
        "| model | link | DDP efficiency at 8 | at 64 | at 1024 | largest world size >= 80% |",
        "|---|---|---:|---:|---:|---|",
    ]
    for spec in specs:
        for name, preds in plans(spec).items():
            ddp = preds[STRATEGIES.index("ddp")]
            eff = [f"{ddp.at(n).efficiency:.2f}" for n in (8, 64, 1024)]
            rows.append(f"| {spec.name} | {name} | {' | '.join(eff)} | {_verdict(preds)} |")
    return "\n".join(rows)


def table(spec: Spec) -> tuple[str, list[str]]:
    """The page's table for one model, and its per-link verdicts."""
    rows = [
        "| link | ranks | DDP step ms | DDP efficiency | picked | step ms | efficiency | "
        "exposed comm ms | peak GiB |",
        "|---|---:|---:|---:|---|---:|---:|---:|---:|",
    ]
    verdicts = []
    for name, preds in plans(spec).items():
        ddp = preds[STRATEGIES.index("ddp")]
        for n in WORLD_SIZES:
            base = f"| {name} | {n} | {1e3 * ddp.at(n).step_s:.1f} | {ddp.at(n).efficiency:.2f} |"
            chosen = pick(preds, n)
            if chosen is None:
                rows.append(f"{base} none fits | | | | |")
                continue
            p = chosen.at(n)
            rows.append(
                f"{base} {chosen.setup['strategy']} | {1e3 * p.step_s:.1f} | "
                f"{p.efficiency:.2f} | {1e3 * p.exposed_comm_s:.1f} | {p.peak_bytes / 2**30:.2f} |"
            )
        verdicts.append(f"{name}: {_verdict(preds)}")
    return "\n".join(rows), verdicts


def render() -> str:
    """docs/scaling.md's text."""
    specs = [mlp(), gpt2_small()]
    parts = [PAGE_HEAD, "\n## Headline\n", headline(specs)]
    for spec in specs:
        prof = paper_profile(spec)
        text, verdicts = table(spec)
        parts.append(
            f"\n## {spec.name}: {spec.numel / 1e6:.1f}M parameters, per-rank batch "
            f"{spec.batch_size}\n\n{spec.note}. One rank: forward {1e3 * prof.forward_s:.3f} ms, "
            f"backward {1e3 * prof.backward_s:.3f} ms, optimizer {1e3 * prof.optimizer_s:.3f} "
            f"ms; {len(prof.buckets)} buckets of gradients ({4 * spec.numel / 2**20:.0f} MiB).\n"
            f"DDP, and the strategy picked at each world size: of those that fit in 80 GiB "
            f"({', '.join(STRATEGIES)}; PowerSGD at rank 4, which changes the gradients), the "
            f"first in that order predicted within {NEAR:.0%} of the fastest:\n\n{text}\n\n"
            f"Largest world size keeping scaling efficiency >= 80%: {'; '.join(verdicts)}.\n"
        )
    parts.append(PAGE_TAIL)
    return "\n".join(parts)


PAGE_HEAD = (
    """# Scaling on paper: GPU ranks from 8 to 1024

Generated by `python -m ddptrain.plan.scaling --out docs/scaling.md` (ddptrain/plan/scaling.py);
do not edit by hand. The formulas and their assumptions are in [plan.md](plan.md).

What `python -m ddptrain.plan` predicts for two models on GPU ranks joined by 25, 100 and 400
Gbit/s links, one NIC per GPU, a ring all-reduce at NCCL's bus bandwidth. Nothing here was
run: the compute is FLOPs at an assumed sustained rate, the links are cited figures.

| link | bus bandwidth per rank | source |
|---|---:|---|
"""
    + "\n".join(
        f"| {name} | {link.bus_bytes_per_s / 1e9:.0f} GB/s | {link.source} |"
        for name, link in NAMED.items()
    )
    + f"""

Per ring hop: {NAMED["nccl-100g"].latency_s * 1e6:.0f} us (links.py's NCCL_HOP_LATENCY_S). The GPU
sustains {DEVICE_FLOPS / 1e12:.0f} TFLOP/s (about 40% of an H100 SXM's 989 dense bf16 TFLOP/s,
NVIDIA's datasheet) and {HBM_BYTES_PER_S / 1e12:.2f} TB/s of HBM; it holds 80 GiB. Efficiency is
one rank's step over the step at n ranks (weak scaling: the per-rank batch stays the same)."""
)

PAGE_TAIL = """
## Which assumptions break first

- **Latency and small buckets.** The ring's 2(n-1) hops cost 2(n-1) x 10 us per bucket: 20 ms
  per bucket at 1024 ranks, which is what sinks every strategy at the largest sizes here. NCCL
  switches to trees (log n hops) at scale, so the real latency term is far smaller; the model
  is pessimistic past about 128 ranks. Larger buckets (bucket_cap_mb) amortize it. ZeRO-1's
  broadcasts, one per owner rank, pay it n times.
- **Congestion.** The bus bandwidth figures are for a non-blocking fabric with one flow per
  NIC. An oversubscribed spine or jobs sharing it lower the bandwidth the ring sees; every
  communication time scales by the ratio.
- **Stragglers.** Every rank is taken to run the same timeline at the same time. A ring runs
  at its slowest rank: a 5% slower GPU, or data loading that stalls one rank, costs every
  rank that time, and more ranks make a slow one likelier.
- **The compute model.** FLOPs at a fixed rate ignore kernel launches (the MLP's layers take
  microseconds, where launch overheads of a few microseconds each matter), and communication
  kernels that slow the overlapped backward down by sharing the GPU's memory bandwidth.
- **Concurrent collectives share nothing.** ZeRO-3's prefetched gathers and its
  reduce-scatters run on two threads, and each is given the link's whole bandwidth: on a real
  NIC they share it, so ZeRO-3's step is underestimated wherever both are in flight.
- **PowerSGD's own cost** (its orthogonalization and matmuls) is taken as free on a GPU, and
  its error feedback buffers are not in the peak.
"""


def main(argv: list[str] | None = None) -> None:
    """Write (or print) docs/scaling.md."""
    p = argparse.ArgumentParser(prog="python -m ddptrain.plan.scaling")
    p.add_argument("--out", type=Path, default=None, help="file to write (default: stdout)")
    args = p.parse_args(argv)
    text = render()
    if args.out is None:
        print(text)
    else:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
