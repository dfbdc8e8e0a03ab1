"""Hooks that send less than the gradients: PowerSGD (low-rank, with error feedback), and
bf16/fp16 on the wire."""

from ddptrain.compress.half import HalfPrecision
from ddptrain.compress.powersgd import PowerSGDState, powersgd_hook

__all__ = ["HalfPrecision", "PowerSGDState", "powersgd_hook"]
