"""Merged-step scheduler over the KV space (kv_space.py). Pure logic: no torch, sockets or Redis.

Each step: a decode token for every running request with one pending (growing, moving or, last,
preempting to make room), then running prefills' next chunks, then waiting requests admitted
in order while the token budget, the running limit, free KV and the admission rule allow. KV
policies are in `kv_policy.py`, admission estimators in `admission.py`, the waiting order in
`policy.py`: FCFS keeps arrival order; a reordering policy (priority, predicted) sorts the
queue by urgency each step, lets its head preempt the least urgent running requests when KV or
the running limit binds (`urgency.py`), and gives the step's prefill budget to running
prefills and waiting requests in urgency order.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from pipellm.services.compute.beam.group import commit_beams, lane_moves, restart
from pipellm.services.compute.core.sequence import UNSAMPLED, SeqStatus, Sequence
from pipellm.services.compute.core.step import ScheduledStep, StepSample, Work, WorkItem
from pipellm.services.compute.scheduling.admission import peak_check
from pipellm.services.compute.scheduling.kv_space import KVSpace
from pipellm.services.compute.scheduling.policy import make_scheduling_policy
from pipellm.services.compute.scheduling.urgency import Urgency
from pipellm.services.compute.speculative.verify import Speculation
from pipellm.shared.config import Batching, SchedulerConfig
from pipellm.shared.messages import Tokens


@dataclass
class SchedulerStats:
    preemptions: int = 0


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVSpace, max_loras: int | None = None,
                 clock: Callable[[], float] | None = None):
        """`kv`: the KV space built from the same config. `max_loras`: the most LoRA adapters
        the running batch may hold requests of (--max-loras; None: any number). `clock`:
        seconds, for arrivals and aging (the simulator's virtual clock; None: monotonic)."""
        self.config, self.kv, self.max_loras = config, kv, max_loras
        self.clock = clock or time.monotonic
        policy = make_scheduling_policy(config)
        self.urgency = Urgency(policy) if policy.reorders else None
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order
        self.stats = SchedulerStats()
        self.peak_check = peak_check(config.kv_admission, kv.policy.peak_admission)
        spec = config.speculative
        self.speculation = Speculation(spec) if spec is not None else None
        self._admitted = 0

    def add(self, seq: Sequence) -> None:
        if seq.max_len > self.kv.capacity:
            raise ValueError(f"request needs up to {seq.max_len} KV slots but the cache holds "
                             f"{self.kv.capacity}")
        if seq.arrival is None:
            seq.arrival = self.clock()
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def used_slots(self) -> int:
        return sum(s.num_cached for s in self.running)

    def demand(self) -> int:
        """The KV tokens its requests are predicted to need: prompt + the median of their
        output length given what they generated, summed over running and waiting ones."""
        return sum(s.num_prompt + s.predicted_length.conditional_quantile(s.num_output, 0.5)
                   for s in (*self.running, *self.waiting))

    def schedule(self) -> ScheduledStep:
        step = ScheduledStep()
        if self.kv.compactor is not None:
            self.kv.compactor.refill()
        urgency = self.urgency
        if urgency is not None and self.config.batching != Batching.STATIC:
            urgency.start(self.clock(), self.waiting, bool(self.running))
            for victim in urgency.victims(self):
                self._preempt(victim)
        else:
            urgency = None
        self._decode(step, urgency)
        budget = self.config.max_batched_tokens - step.num_tokens
        prefilling = [seq for seq in self.running if seq.pending > 1]
        if urgency is not None:  # the step's budget to the most urgent first
            urgency.order(self.waiting)
            prefilling.sort(key=urgency.key)
        for seq in prefilling:
            if budget <= 0:
                break
            if urgency is not None:
                budget = self._admit_waiting(step, budget, before=urgency.key(seq))
            n = min(seq.pending, budget)
            if n > 0:
                step.items.append(WorkItem.prefill(seq, n))
                budget -= n
        self._admit_waiting(step, budget)
        step.items.sort(key=lambda item: item.kind)  # stable: in running order within a kind
        return step

    def _decode(self, step: ScheduledStep, urgency: Urgency | None) -> None:
        """A decode token for every running request with one pending, served in admission
        order, or most urgent first under a reordering policy; one whose KV must grow may
        preempt only requests served after it (`_make_room`). Items in admission order."""
        order = list(self.running) if urgency is None else sorted(self.running, key=urgency.key)
        first, items = len(step.items), step.items
        for i, seq in enumerate(order):
            if seq.status is not SeqStatus.RUNNING or seq.pending != 1 or seq.at_limit:
                continue  # (preempted for one served before it, or not decoding)
            if not self._make_room(seq, step, order[i + 1:], urgency):
                continue
            if seq.beams is not None:  # its forks' K/V copied first
                step.moves.extend(lane_moves(seq))
                items.append(WorkItem.beam(seq))
            else:
                deciding = sum(s.status is SeqStatus.RUNNING for s in order[i:]) \
                    if self.speculation is not None else 0
                items.append(WorkItem.decode(seq, self._drafts(seq, step, deciding)))
        if urgency is not None:  # (fcfs's order is the admission order already)
            items[first:] = sorted(items[first:], key=lambda item: item.seq.admit_order)

    def _drafts(self, seq: Sequence, step: ScheduledStep, deciding: int) -> list[int]:
        """Speculative drafts for seq's decode (none without --speculative-config), within
        the step's tokens left after one for each of the `deciding` requests from seq on."""
        if self.speculation is None:
            return []
        budget = self.config.max_batched_tokens - step.num_tokens - deciding
        return self.speculation.drafts(seq, len(self.running), budget)

    def _admit_waiting(self, step: ScheduledStep, budget: int, before: tuple | None = None,
                       ) -> int:
        """Admission into `step` in queue order: nobody overtakes the head of the queue;
        `before`: only requests more urgent than this key. Static batching admits only into an
        empty batch, all that fit at once (their prompts then prefill in chunks over the next
        steps). Returns the budget left."""
        static = self.config.batching == Batching.STATIC
        if static and self.running or before is not None and \
                not (self.waiting and self.urgency.key(self.waiting[0]) < before):
            return budget
        peak, check = None, self.peak_check
        if check is not None and self.waiting:
            peak = check(self.running, self.config.kv_peak_quantile, self.kv.capacity)
        while self.waiting and (budget > 0 or static) and \
                len(self.running) < self.config.max_running:
            seq = self.waiting[0]
            if before is not None and not self.urgency.key(seq) < before:
                break
            if peak is not None and not peak.fits(seq):
                break
            if not self._adapter_fits(seq):  # it waits, in line, for an adapter to leave
                break
            if not self._admit(seq, step):
                break
            self.waiting.popleft()
            step.admitted.append(seq)
            n = min(seq.pending, budget)
            if n:
                step.items.append(WorkItem.prefill(seq, n))
                budget -= n
        return budget

    def advance(self, step: ScheduledStep) -> None:
        """Account for a launched step before its results are back: its K/V count as cached and
        each sampled request gets UNSAMPLED tokens, so the next step can be scheduled while
        this one runs. A request whose sampled token is its last by length is not scheduled
        again (Sequence.at_limit)."""
        cache = self.kv.prefix_cache
        for item in step.items:
            seq = item.seq
            seq.num_cached += item.cached  # a verify's k + 1: the rejected ones' overwritten
            if cache is not None and item.kind is Work.PREFILL and \
                    seq.num_cached >= seq.num_prompt:
                cache.share(seq)  # its prompt's K/V may serve others now
            if item.samples and seq.status is not SeqStatus.FINISHED:
                item.token_index = len(seq.token_ids)
                seq.token_ids.append(UNSAMPLED)  # a beam search samples one position
                if item.kind is Work.VERIFY:
                    seq.token_ids += [UNSAMPLED] * (item.samples - 1)

    def commit(self, step: ScheduledStep, out: StepSample) -> StepSample:
        """Apply an advanced step's results, in step order: fill in the sampled tokens (and
        the prompt logprobs asked for), retire the requests they finish. Returns the records
        applied (the rows a verify commits merged into one), each one's place and finish filled
        in; requests finished or aborted since the step was scheduled are left out (their
        extra token is dropped)."""
        done = StepSample()
        prefilled = {item.seq.request_id: item.seq for item in step.of(Work.PREFILL)}
        for piece in out.prompt:
            seq = prefilled[piece.request_id]
            if seq.status is not SeqStatus.FINISHED:
                seq.prompt_logprobs += piece.logprobs
                done.prompt.append(piece)
        outputs, row = out.outputs, 0
        drafted = None if out.drafts is None else iter(out.drafts)  # the draft model's
        for item in step.items:
            seq, n = item.seq, item.samples
            row += n
            drafts = next(drafted) if drafted and item.kind is Work.VERIFY else item.drafts
            if n == 0 or seq.status is SeqStatus.FINISHED:
                continue
            if seq.beams is not None:  # its rows (its prompt's last one first) advance it
                done.outputs += commit_beams(seq, outputs[row - n : row])
            else:
                self._fill(item, outputs[row - n : row], drafts, done.outputs)
            if seq.finish_reason is not None:
                self._retire(seq)
        return done

    def _fill(self, item: WorkItem, records: list[Tokens], drafts: list[int],
              done: list[Tokens]) -> None:
        """Fill in one item's sampled tokens; append its records applied to `done` (a
        verify's merged into its first)."""
        seq = item.seq
        for j, record in enumerate(records):
            index = item.token_index + j
            if index >= len(seq.token_ids):
                break  # an earlier row's token rejected this row's draft
            seq.fill(index, record.token_ids[0], record.logprobs[0])
            record.start, record.finish_reason = index, seq.finish_reason
            if j:
                done[-1].extend(record)
            else:
                done.append(record)
            if item.kind is Work.VERIFY:
                self.speculation.verified(seq, drafts, j, index)
            if seq.finish_reason is not None:
                break

    def update(self, step: ScheduledStep, out: StepSample) -> StepSample:
        """advance + commit: a step run to completion before the next is scheduled."""
        self.advance(step)
        return self.commit(step, out)

    def abort(self, seq: Sequence, reason: str = "abort") -> None:
        if seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        elif seq.status is SeqStatus.RUNNING:
            self._release(seq)
        seq.finish_reason = seq.finish_reason or reason
        seq.status = SeqStatus.FINISHED

    def _retire(self, seq: Sequence) -> None:
        if seq.status is SeqStatus.RUNNING:
            self._release(seq, keep=True)
        elif seq.status is SeqStatus.WAITING:  # preempted while its last step was in flight
            self.waiting.remove(seq)
        seq.status = SeqStatus.FINISHED

    def _adapter_fits(self, seq: Sequence) -> bool:
        """Whether seq's LoRA adapter (if any) may join the running batch: one of its
        adapters already, or fewer than max_loras there."""
        name = seq.params.lora_name
        if not name or self.max_loras is None:
            return True
        running = {s.params.lora_name for s in self.running} - {""}
        return name in running or len(running) < self.max_loras

    def reservation(self, seq: Sequence) -> int:
        """Slots seq's segment takes at admission (a beam search's: a lane of max_len slots
        per beam)."""
        return self.kv.policy.reservation(seq) if seq.beams is None else \
            seq.beams.width * seq.max_len

    def _admit(self, seq: Sequence, step: ScheduledStep) -> bool:
        size = self.reservation(seq)
        if not self.kv.policy.can_admit(self.kv.allocator, size):
            return False
        # requests asking for prompt logprobs bypass the cache: those are computed in prefill
        cache = self.kv.prefix_cache if seq.params.prompt_logprobs is None else None
        entry, hit = cache.lookup(seq) if cache is not None else (None, 0)
        start = self.kv.allocate(size, self.running, step.moves, spare=entry)
        if start is None:
            return False
        seq.kv_start, seq.kv_reserved = start, size
        if cache is not None:
            cache.admitted(seq, entry, hit)
        if hit:  # the prefix's K/V copied in before the step runs
            step.moves.append((entry.kv_start, start, hit))
            seq.num_cached = hit
            if seq.admit_order < 0:
                seq.cached_tokens = min(hit, seq.num_prompt)
        seq.status = SeqStatus.RUNNING
        seq.admit_order = self._admitted
        self._admitted += 1
        self.running.append(seq)
        return True

    def _make_room(self, seq: Sequence, step: ScheduledStep, later: list[Sequence],
                   urgency: Urgency | None) -> bool:
        """Ensure seq's segment holds its pending token, preempting (if it must) one of
        `later`, the running requests served after it this step: the KV policy's choice, or
        under a reordering policy the least urgent that helps of those less urgent than seq
        (Urgency.yielding). False if seq itself had to be preempted."""
        candidates = None if urgency is None else urgency.yielding(seq, later)
        while (victim := self.kv.grow(seq, self.running, step.moves, candidates)) is not None:
            self._preempt(victim)
            if victim is seq:
                return False
            if candidates is not None:
                candidates.remove(victim)
        return True

    def _release(self, seq: Sequence, keep: bool = False) -> None:
        """Take seq out of the running batch and free its KV segment (`keep`: KVSpace.release)."""
        self.running.remove(seq)
        self.kv.release(seq, keep)

    def _preempt(self, seq: Sequence) -> None:
        """Free seq's KV and requeue it first in line; it recomputes prompt + output later (a
        beam search starts over)."""
        self._release(seq)
        if seq.beams is not None:
            restart(seq)
        seq.num_cached, seq.kv_start, seq.kv_reserved = 0, -1, 0
        seq.status = SeqStatus.WAITING
        seq.preemptions += 1
        if self.urgency is not None:
            self.urgency.forget(seq)
        self.waiting.appendleft(seq)  # a reordering policy sorts it into place
        self.stats.preemptions += 1
