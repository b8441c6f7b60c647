"""What runs each step: a request's state (`sequence.py`), the merged-step scheduler and its
admission rule. Pure logic: no torch, sockets or Redis."""
