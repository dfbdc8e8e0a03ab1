"""`python -m ddptrain.bench [--recipe | --memory] ...`: step times, the whole run, or memory."""

import sys

from ddptrain.bench import memory, recipe, steps

argv = sys.argv[1:]
if "--recipe" in argv:
    recipe.main(argv)
elif "--memory" in argv:
    memory.main(argv)
else:
    steps.main(argv)
