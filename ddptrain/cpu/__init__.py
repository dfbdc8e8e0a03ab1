"""CPU transports for the DDP wrapper: shared memory on one host, TCP across hosts, a ring."""
