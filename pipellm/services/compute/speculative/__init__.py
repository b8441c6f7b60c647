"""Speculative decoding (`--speculative-config`): proposers of draft tokens. Pure logic.

A request about to decode with k drafts d1..dk runs k + 1 decode rows in the merged step:
its pending token and the drafts, at positions c..c+k, row j attending to c + 1 + j keys, so
that each row computes exactly what a plain decode step would (pipellm/services/compute/batch.py).
The step samples each of the k+1 rows as plain decoding would sample that position
(same params, same seed, the step counter of that output index), and the scheduler commits
the tokens x0..xj up to the first xi != d(i+1), plus that xi: x0 always. Because a draft of
n-gram lookup is one token with probability 1, this is the speculative-sampling rule exactly
(accept d with probability p(d); on a rejection, sample p without d): greedy output is
token-exact with plain decoding and a seeded request draws what it would have drawn. The KV
of rejected drafts stays in the segment, overwritten by the next step (num_cached says which
slots hold the sequence's KV).
"""
