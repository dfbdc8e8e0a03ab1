"""Benchmarks: `python -m ddptrain.bench` step times (steps.py, report.py, placement.py),
`--two-hosts` the same across two fake hosts (hosts.py), `--recipe` whole runs (recipe.py),
`--memory` peak memory (memory.py); `python -m ddptrain.bench.batchnorm`."""
