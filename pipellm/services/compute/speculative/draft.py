"""Draft-model proposer (`{"model": PATH}`): the scheduler's side. A decode gets k rows whose
tokens are DRAFTED placeholders; the runner's Drafter (pipellm/services/compute/drafter.py) fills
them with the draft model's greedy tokens on the device before the target's forward, and returns
them with the step's results (StepSample.drafts). A request backs off after poor verifies
(backoff.py)."""

from __future__ import annotations

from pipellm.services.compute.core.sequence import UNSAMPLED, Sequence
from pipellm.services.compute.speculative.backoff import Backoff
from pipellm.shared.speculative import SpeculativeConfig

DRAFTED = -2  # a draft row's token id until the draft model has proposed it


class DraftModelProposer:
    def __init__(self, config: SpeculativeConfig):
        self.k = config.num_speculative_tokens
        self.backoff = Backoff()

    def propose(self, seq: Sequence, limit: int) -> list[int]:
        """min(k, limit) placeholders for the draft model's tokens ([] while backing off)."""
        if limit <= 0 or seq.token_ids[-1] == UNSAMPLED or self.backoff.skipping(seq):
            return []
        return [DRAFTED] * min(self.k, limit)

    def verified(self, seq: Sequence, drafted: int, accepted: int) -> None:
        self.backoff.verified(seq, drafted, accepted)
