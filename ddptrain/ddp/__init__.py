"""The core: the DDP wrapper, its buckets and torch's comm-hook and join protocols."""
