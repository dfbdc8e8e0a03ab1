"""Benchmarks: `python -m ddptrain.bench` (steps.py) and its report (report.py)."""
