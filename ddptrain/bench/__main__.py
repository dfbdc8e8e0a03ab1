"""`python -m ddptrain.bench [--recipe | --memory | --capped | --deterministic | --two-hosts] ...`:
step times, the whole run, memory, training under a memory cap, what the deterministic mode
costs, or step times across two hosts made in this machine."""

import sys

from ddptrain.bench import capped, deterministic, hosts, memory, recipe, steps
from ddptrain.netns import HostsUnavailable

argv = sys.argv[1:]
if "--two-hosts" in argv:
    try:
        hosts.main(argv)
    except (HostsUnavailable, hosts.RunFailed) as e:
        sys.exit(f"error: {e}")
elif "--recipe" in argv:
    recipe.main(argv)
elif "--memory" in argv:
    memory.main(argv)
elif "--capped" in argv:
    capped.main(argv)
elif "--deterministic" in argv:
    deterministic.main(argv)
else:
    steps.main(argv)
