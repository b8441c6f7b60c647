"""The scheduler's speculative side (pure logic): which drafts a decode gets, and what each
committed row of a verify means for its sequence (pipellm/services/compute/speculative/ says
why)."""

from __future__ import annotations

from pipellm.services.compute.core.sequence import Sequence
from pipellm.services.compute.speculative.draft import DraftModelProposer
from pipellm.services.compute.speculative.ngram import NgramProposer
from pipellm.shared.speculative import SpeculativeConfig


class Speculation:
    """Drafts for decodes (`drafts`) and the bookkeeping of their verification (`verified`);
    counts drafts and accepted ones in `draft_tokens`, `accepted_tokens`."""

    def __init__(self, config: SpeculativeConfig):
        self.proposer = NgramProposer(config) if config.method == "ngram" else \
            DraftModelProposer(config)
        self.max_batch = config.disable_by_batch_size  # running requests, at most
        self.host_drafts = config.method == "ngram"  # drafts known when scheduled
        self.draft_tokens = self.accepted_tokens = 0

    def drafts(self, seq: Sequence, running: int, budget: int) -> list[int]:
        """Drafts for seq's decode: as many as its limits leave room for (every accepted token
        must be one it may still generate), its KV segment holds as reserved (drafts never
        grow a segment, so never preempt anyone) and `budget` (the step's tokens left after
        one for every request still to decode); with a grammar, the drafts it accepts (each
        verify row is masked as after the drafts before it); none for requests whose sampling
        reads their tokens (penalties), nor for a grammar's drafts a draft model would propose
        (unknown to the host until the step runs), nor while more than disable_by_batch_size
        requests run (`running`)."""
        if seq.params.reads_output or running > self.max_batch or \
                (seq.grammar is not None and not self.host_drafts):
            return []
        limit = min(budget, seq.params.max_tokens - seq.num_output - 1,
                    seq.max_len - seq.num_tokens - 1, seq.kv_reserved - seq.num_tokens)
        drafts = self.proposer.propose(seq, limit)
        if seq.grammar is not None:
            drafts = drafts[: seq.grammar.valid_prefix(drafts)]
        self.draft_tokens += len(drafts)
        return drafts

    def verified(self, seq: Sequence, drafts: list[int], j: int, index: int) -> None:
        """Row j of seq's verify committed token_ids[index]. Equal to draft j (which row j + 1
        was fed), the next row's token follows; else, past the last draft, or where the token
        ends the request, the rows after it are dropped and seq's KV ends before it (as a
        plain decode's: its last token has none yet)."""
        accepted = j < len(drafts) and seq.token_ids[index] == drafts[j]
        self.accepted_tokens += accepted
        if accepted and seq.finish_reason is None:
            return
        del seq.token_ids[index + 1:]
        seq.num_cached = index
        self.proposer.verified(seq, len(drafts), j + accepted)  # the drafts it accepted
