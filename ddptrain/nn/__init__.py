"""Layers that communicate: SyncBatchNorm."""
