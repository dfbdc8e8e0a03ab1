"""A small training job with an injected fault, for the fault-tolerance tests.

    torchrun --standalone --nproc_per_node=2 --max-restarts=1 tests/support/fault_job.py \\
        --ckpt-dir /tmp/ck --out /tmp/final.pt --fault kill:1:7
    RANK=0 WORLD_SIZE=3 MASTER_ADDR=127.0.0.1 MASTER_PORT=29555 \\
        python tests/support/fault_job.py ...

Rank 0 writes the final parameters to --out. --fault KIND:RANK:STEP as in toy_models.ToyTrainer.
`main(argv)` runs the same job in a rank that ddptrain.spawn started (a reference run).
"""

from __future__ import annotations

import argparse
import sys

import torch
from torch.distributed.elastic.multiprocessing.errors import record

try:
    from toy_models import ToyTrainer  # a sibling: this file runs as a script
except ImportError:  # imported by a test, as support.fault_job
    from support.toy_models import ToyTrainer

from ddptrain.train.config import TrainerConfig


@record
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt-dir", default=None)
    p.add_argument("--checkpoint-every", type=int, default=3)
    p.add_argument("--out", default=None)
    p.add_argument("--fault", default=None, help="KIND:RANK:STEP")
    p.add_argument("--stamp", default=None, help="file to write the time of a kill/freeze")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--heartbeat-timeout", type=float, default=30.0)
    p.add_argument("--nonfinite", default="stop")
    p.add_argument("--check-replicas-every", type=int, default=None)
    p.add_argument("--comm-hook", default="default")
    p.add_argument("--sleep-per-step", type=float, default=0.0)
    p.add_argument("--log-dir", default=None)
    p.add_argument("--log-every", type=int, default=4)
    p.add_argument("--max-steps", type=int, default=None)
    args = p.parse_args(argv)
    fault = None
    if args.fault:
        kind, rank, step = args.fault.split(":")
        fault = {"kind": kind, "rank": int(rank), "step": int(step), "stamp": args.stamp}
    config = TrainerConfig(
        global_batch_size=12,
        epochs=args.epochs,
        max_steps=args.max_steps,
        log_every_steps=args.log_every,
        log_dir=args.log_dir,
        checkpoint_dir=args.ckpt_dir,
        checkpoint_every_steps=args.checkpoint_every if args.ckpt_dir else None,
        resume="auto" if args.ckpt_dir else None,
        keep_last=20,
        progress_bar=False,
        heartbeat_timeout_s=args.heartbeat_timeout,
        nonfinite=args.nonfinite,
        check_replicas_every=args.check_replicas_every,
        comm_hook=args.comm_hook,
    )
    trainer = ToyTrainer(config, dropout=0.3, fault=fault, step_sleep_s=args.sleep_per_step)
    summary = trainer.fit()
    if trainer.info.rank == 0 and args.out:
        params = [p.detach().clone() for p in trainer.model.module.parameters()]
        torch.save({"params": params, "summary": summary}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
