"""Hidden-state output-length prediction: the head, its shared statistics, the engine hook."""
