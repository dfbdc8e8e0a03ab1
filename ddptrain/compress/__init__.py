"""Hooks that send less than the gradients: PowerSGD (low-rank, with error feedback)."""

from ddptrain.compress.powersgd import PowerSGDState, powersgd_hook

__all__ = ["PowerSGDState", "powersgd_hook"]
