"""Benchmarks: `python -m ddptrain.bench` (steps.py), --recipe (recipe.py), --memory (memory.py)."""
