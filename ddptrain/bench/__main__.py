"""`python -m ddptrain.bench [--recipe | --gpt | --memory | --capped | --two-hosts] ...`: step
times, the whole run, a GPT against the plain loop, memory, training under a memory cap, or step
times across two hosts made in this machine."""

import sys

from ddptrain.bench import capped, gpt, hosts, memory, recipe, steps
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
else:
    steps.main(argv)
