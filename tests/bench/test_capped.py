"""Training under a per-rank memory cap: what ZeRO-3 is for."""

from __future__ import annotations

from ddptrain.bench import capped

# 16.6M parameters (63 MiB) and AdamW at world size 4. Measured peak address space above each
# rank's base (2-core AMD EPYC): DDP 296 MiB (weights, gradient buckets, two moments: 4 x 63,
# and the activations), ZeRO-3 140 MiB (the whole weights while building the model, then a
# quarter of the rest and a few units). 210 MiB leaves ZeRO-3 70 MiB of room and DDP 86 short.
WIDTH, DEPTH, CAP_MIB = 1024, 16, 210


def test_a_model_over_the_cap_trains_with_zero3_and_fails_with_ddp():
    """Under a 210 MiB cap per rank at ws=4, AdamW DDP fails to allocate; ZeRO-3 trains 2 steps."""
    ddp = capped.run("ddp", 4, WIDTH, DEPTH, 2, CAP_MIB)
    zero3 = capped.run("zero3", 4, WIDTH, DEPTH, 2, CAP_MIB)
    assert not ddp["trained"] and "allocate memory" in ddp["error"], ddp
    assert zero3["trained"], zero3
    peak = max(r["peak_vm_above_cap_base_mib"] for r in zero3["ranks"])
    print(f"ZeRO-3 peak address space {peak:.0f} MiB of {CAP_MIB}; DDP: {ddp['error']}")
    assert all(len(r["losses"]) == 2 for r in zero3["ranks"])
