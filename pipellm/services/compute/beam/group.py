"""A beam request inside the scheduler: its lanes' KV copies and the commit of its rows."""

from __future__ import annotations

from pipellm.services.compute.core.sequence import Sequence
from pipellm.shared.codec import float32s, int32s
from pipellm.shared.messages import Tokens


def lane_moves(seq: Sequence) -> list[tuple[int, int, int]]:
    """The KV moves (src, dst, n) of the forks seq's last step made: each copies the cached
    slots of a parent's lane into the lane of its extra child (lane b at kv_start + b * max_len)."""
    lane, copies = seq.max_len, seq.beams.copies
    seq.beams.copies = []
    return [(seq.kv_start + a * lane, seq.kv_start + b * lane, seq.num_cached) for a, b in copies]


def commit_beams(seq: Sequence, records: list[Tokens]) -> list[Tokens]:
    """Apply one step's rows of seq's running beams (records[i]: running[i]'s top K). While
    the search goes on, seq's tokens follow its best beam and nothing is returned; when it
    ends, seq finishes (its tokens and cached K/V back to the prompt's, which lane 0 holds)
    and the records of its n best hypotheses are returned, best first."""
    search = seq.beams
    search.step([(list(r.top_ids), list(r.top_logprobs)) for r in records])
    if not search.done:
        seq.token_ids[seq.num_prompt:] = search.running[0].tokens
        return []
    del seq.token_ids[seq.num_prompt:]
    seq.num_cached = min(seq.num_cached, seq.num_prompt)
    hyps = search.results(seq.params.beam_n)
    seq.finish_reason = hyps[0].finish_reason
    return [Tokens(seq.request_id, seq.num_prompt, int32s(h.tokens), float32s(h.logprobs),
                   finish_reason=h.finish_reason) for h in hyps]


def restart(seq: Sequence) -> None:
    """seq was preempted: its search starts over from the prompt."""
    seq.beams.restart()
    del seq.token_ids[seq.num_prompt:]
