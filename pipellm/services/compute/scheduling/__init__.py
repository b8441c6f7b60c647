"""What runs each step: the merged-step scheduler, its admission rule and KV policies. Pure
logic: no torch, sockets or Redis. The request state it moves lives in `core/`."""
