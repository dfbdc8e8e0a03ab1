"""ZeRO stages 2 and 3: parameters, gradients and optimizer state sharded across ranks."""
