"""What one synchronized backward of the DDP wrapper tracks, reset after every one, and the
errors a gradient arriving out of turn is met with."""

from __future__ import annotations

from typing import Any


# A plain object, not attributes of the wrapper: every attribute write on an nn.Module goes
# through its slow __setattr__ (~10 us each), and the hooks write several per parameter.
class StepState:
    """What one synchronized backward tracks."""

    __slots__ = (
        "armed",
        "callback_queued",
        "claimed",
        "divisor",
        "jobs",
        "next_bucket",
        "no_sync_forward",
        "pending",
        "ready",
        "sync_buffers",
        "used",
    )

    def __init__(self, n_params: int, bucket_lens: list[int], divisor: int) -> None:
        self.armed = False
        # A transport's gradients are scaled by 1/divisor: world_size, or under join the ranks
        # still training (1 for a torch hook, which divides by itself).
        self.divisor = divisor
        self.callback_queued = False
        self.next_bucket = 0
        # A forward with grad enabled ran under no_sync() since the last synchronized backward.
        self.no_sync_forward = False
        self.pending = list(bucket_lens)
        self.ready = [False] * n_params
        # Bucket slots handed to autograd as a gradient's output (linear_grads.py).
        self.claimed = [False] * n_params
        # "Used here" since the last synchronized backward, no_sync passes included.
        self.used = [False] * n_params
        # Per bucket, its reduction as submitted to the wrapper's runner.
        self.jobs: list[Any] = [None] * len(bucket_lens)
        # A forward asked for rank 0's buffers with the last bucket (norm statistics only).
        self.sync_buffers = False

    def check_arrival(self, index: int, name: str, grad: Any) -> None:
        """Raise, naming parameter `name`, where its gradient arriving now (synchronized) would
        break the wrapper's contract: one forward, then at most one backward, outside no_sync."""
        if not self.armed and self.no_sync_forward:
            raise RuntimeError(
                f"gradient of '{name}' arrived in a backward outside no_sync() whose forward ran "
                "inside it: the forward decides whether gradients are averaged. Run the forward "
                "and its backward both inside no_sync() (to accumulate) or both outside (to "
                "synchronize)"
            )
        if not self.armed:
            raise RuntimeError(
                f"gradient of '{name}' arrived with no forward pass since the last synchronized "
                "backward: backward was called twice on one forward under "
                "DistributedDataParallel. Run a new forward before each backward, or use "
                "no_sync() for the extra backward passes"
            )
        if self.ready[index]:
            raise RuntimeError(f"gradient of '{name}' became ready twice in one backward")
        if grad is not None and grad.requires_grad:
            raise RuntimeError(
                "backward(create_graph=True) is not supported under DistributedDataParallel "
                "(nor under torch's): averaged gradients are written into buckets outside "
                "autograd. For a gradient penalty, take torch.autograd.grad(loss, params, "
                "create_graph=True), add the penalty to the loss, then call backward() on it"
            )
