"""How processes are started: launcher variables (env.py) and ddptrain.spawn (spawn.py)."""
