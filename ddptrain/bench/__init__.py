"""Benchmarks: `python -m ddptrain.bench` step times (steps.py, report.py), `--recipe` whole runs
(recipe.py), `--memory` peak memory (memory.py); `python -m ddptrain.bench.batchnorm`."""
