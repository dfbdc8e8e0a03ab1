from ddptrain.bench.steps import main

main()
