"""Beam search (`use_beam_search`): a request's W beams decoded side by side. Pure logic.

A beam request is one Sequence, one admission unit: its KV segment holds W lanes of
max_len slots each (lane b at kv_start + b * max_len), and every decode step runs one row per
running beam, each in its own lane. The prompt is prefilled once, in lane 0; a beam that
forks from another gets that lane's K/V copied into a free lane (a KV move before the next
step: copy-on-fork of the contiguous lane). Each row returns the K most likely next tokens
with their log-probabilities (the model's own, log_softmax of the logits), and `BeamSearch`
picks the next beams and the finished hypotheses exactly as transformers'
`generate(num_beams=W)` does. Nothing streams: the n best hypotheses are the request's
output when the search ends. A preempted beam request starts its search over.
"""
