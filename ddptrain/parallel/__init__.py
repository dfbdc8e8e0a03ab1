"""Parallel: the DDP wrapper, bucket assignment, communication hooks, shared memory."""
