"""`python -m ddptrain.bench [MODE] ...`, MODE one of --recipe, --gpt, --memory, --capped,
--deterministic, --two-hosts (none: step times): the whole run, a GPT against the plain loop,
memory, training under a memory cap, what the deterministic mode costs, or step times across two
hosts made in this machine."""

import sys

from ddptrain.bench import capped, deterministic, gpt, hosts, memory, recipe, steps
from ddptrain.netns import HostsUnavailable

argv = sys.argv[1:]
if "--two-hosts" in argv:
    try:
        hosts.main(argv)
    except (HostsUnavailable, hosts.RunFailed) as e:
        sys.exit(f"error: {e}")
elif "--recipe" in argv:
    recipe.main(argv)
elif "--gpt" in argv:
    gpt.main(argv)
elif "--memory" in argv:
    memory.main(argv)
elif "--capped" in argv:
    capped.main(argv)
elif "--deterministic" in argv:
    deterministic.main(argv)
else:
    steps.main(argv)
