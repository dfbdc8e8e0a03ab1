"""Training: Trainer and its config, logging, checkpoints, distributed evaluation, health checks."""
