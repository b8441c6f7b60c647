"""Admission with predicted lengths: will the future KV peak still fit? Pure logic."""

from __future__ import annotations

from services.compute.scheduling.sequence import Sequence


class FuturePeak:
    """The most KV slots the running requests (plus those admitted through `fits`) will hold
    at once, if each generates up to the peak quantile of its length and then frees its slots:
    with remaining lengths r sorted, the demand when the k-th finishes is the sum over those
    still running of (tokens now + r_k). Each request's bound is cached in `peak_total` and
    recomputed (conditioned on its output so far) once it is outgrown."""

    def __init__(self, running: list[Sequence], quantile: float, capacity: int):
        self.q, self.capacity = quantile, capacity
        self.items = sorted(self._item(s) for s in running)  # (remaining, tokens)

    def _item(self, seq: Sequence) -> tuple[int, int]:
        if seq.peak_total <= seq.num_output:
            seq.peak_total = seq.predicted_length.conditional_quantile(seq.num_output, self.q)
        total = min(seq.peak_total, seq.max_len - seq.num_prompt)
        return max(total - seq.num_output, 1), seq.num_tokens

    def fits(self, seq: Sequence) -> bool:
        """Whether the peak still fits with `seq` running too; if so `seq` is counted."""
        items = sorted([*self.items, self._item(seq)])
        peak = tokens = 0
        for k in range(len(items) - 1, -1, -1):  # suffix sums: requests lasting >= r_k
            r, t = items[k]
            tokens += t
            peak = max(peak, tokens + (len(items) - k) * r)
        if peak > self.capacity and len(items) > 1:  # alone, it always gets its chance
            return False
        self.items = items
        return True
