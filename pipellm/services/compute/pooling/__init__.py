"""The pooling runner's core: whole prompts' pooled embeddings through the generation model.

`embed(engine, prompts, pooling, dimensions)` (embedder.py) batches the prompts up to the token
budget, runs their prefill (forward.py: the final-normed hidden states, no logits), pools them
(pool.py) and frees the KV slots it took.
"""

from pipellm.services.compute.pooling.embedder import NoKVRoom, embed, forward_budget
from pipellm.services.compute.pooling.pool import finish, pool

__all__ = ["NoKVRoom", "embed", "finish", "forward_budget", "pool"]
