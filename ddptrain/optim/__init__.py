"""Optimizers over the wrapper: ZeRO (sharded optimizer state)."""
