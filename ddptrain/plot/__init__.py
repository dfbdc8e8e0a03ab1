"""Pictures of a run: training curves from metrics.jsonl, a timeline from profiler traces.

    python -m ddptrain.plot runs/ws1 runs/ws2 -o curves.png      # several runs overlaid
    python -m ddptrain.plot --timeline runs/ws2/trace-rank*.json -o timeline.png

Needs matplotlib (pip install 'ddptrain[plot]'). curves.py and timeline.py each split into
pure readers (records/traces in, series/spans out; unit-tested) and one drawing function.
"""
