"""The engine: scheduler + allocator + model runner, one merged step at a time.

With the overlap schedule (`--overlap-schedule`, on by default on CUDA), step N+1 is scheduled
and launched while the device still runs step N, and step N's tokens are committed after that:
the host never waits for the device except for the ids it needs to finish requests. A request
step N finishes (stop token) then ran once more in step N+1; that token is dropped. A step that
reads token values on the host (penalties) commits the step in flight first.

This class runs in-process for `pipellm generate`; the compute service wraps the same class.
"""

from __future__ import annotations

import itertools
import secrets
import time
from dataclasses import dataclass, field

from pipellm.services.compute.beam.search import BeamSearch
from pipellm.services.compute.core.sequence import SeqStatus, Sequence
from pipellm.services.compute.core.step import ScheduledStep
from pipellm.services.compute.length.refiner import LengthRefiner
from pipellm.services.compute.length.store import memory_stores
from pipellm.services.compute.lora.adapters import Adapters
from pipellm.services.compute.pooling.tasks import PoolingTasks
from pipellm.services.compute.scheduling.kv_space import KVSpace
from pipellm.services.compute.scheduling.scheduler import Scheduler
from pipellm.services.compute.step_stats import StepCounts
from pipellm.services.compute.structured import GrammarState, ReasoningGate
from pipellm.shared.config import EngineConfig
from pipellm.shared.length_dist import LengthDist
from pipellm.shared.messages import Tokens
from pipellm.shared.sampling import InvalidParams, SamplingParams


@dataclass(frozen=True)
class StepResult:
    outputs: list[Tokens]  # one per request that got a token, in batch order
    admitted: list[str]  # request ids taken from the queue (first time or after preemption)
    cached_tokens: list[int] = field(default_factory=list)  # per admitted: from the prefix cache
    prompt: list[Tokens] = field(default_factory=list)  # scored prompt pieces


@dataclass(frozen=True)
class EngineStats:
    capacity: int
    reserved: int
    used: int
    running: int
    waiting: int
    moves: int
    grows_in_place: int
    preemptions: int
    prefix_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_hits: int = 0  # of them, copied from it
    prefix_cached: int = 0  # slots the cache's entries hold
    prefix_evictions: int = 0
    spec_draft_tokens: int = 0  # speculative drafts verified (vLLM's spec_decode_num_draft_tokens)
    spec_accepted_tokens: int = 0  # of them, accepted
    demand: int = 0  # predicted KV tokens of the requests it holds (what routing balances)
    prefill: int = 0  # prompt tokens it holds not yet prefilled (routing: what TTFT waits behind)
    step_tokens: int = 0  # tokens a step takes (--max-batched-tokens): how fast that backlog goes
    requests: int = 0  # requests added since start
    tokens: int = 0  # output tokens committed since start


class LLMEngine(PoolingTasks):
    def __init__(self, config: EngineConfig, runner, length_stores=None):
        """`runner`: a ModelRunner or SimRunner (pipellm/services/compute/backend.py makes the one
        --backend names), holding the model's config, the context length and the KV slots.
        `length_stores(dim)`: where the hidden-state length heads' statistics live (stage ->
        RedisStore when served, store.redis_stores; None: this process's memory), given the
        probe's width. No head without the runner's probe (`--hidden-length`)."""
        self.config = config
        self.runner = runner
        self.model_config, self.max_model_len = runner.model_config, runner.max_model_len
        self.adapters = Adapters(runner, config.max_lora_rank)  # SamplingParams.lora_name's
        self.kv = KVSpace(config.scheduler, self.runner.capacity)
        clock = getattr(runner, "clock", None)  # the simulator's virtual clock, if any
        self.scheduler = Scheduler(config.scheduler, self.kv,
                                   config.max_loras if config.enable_lora else None,
                                   clock=None if clock is None else lambda: clock.now)
        self.requests: dict[str, Sequence] = {}
        self._ids = itertools.count()
        mode = config.overlap_schedule
        self.overlap = mode == "on" or (mode == "auto" and runner.asynchronous)
        # speculation proposes from committed tokens and commits a varying number of them
        self.overlap = self.overlap and config.scheduler.speculative is None
        self._inflight = None  # (ScheduledStep, its runner handle): launched, not committed
        self._added = 0  # requests added (EngineStats)
        self.counts = StepCounts()  # what the steps ran (EngineStats, the stats line)
        # the runner decides which rows are checkpoints (--length-refine-every)
        self.lengths = LengthRefiner((length_stores or memory_stores)(runner.probe_dim)) \
            if getattr(runner, "probe", None) is not None else None

    def add_request(self, prompt_ids: list[int], params: SamplingParams,
                    request_id: str | None = None,
                    predicted_length: LengthDist | int | None = None,
                    output_ids: list[int] = (), grammar=None, priority: int = 0) -> str:
        """Queue a request. `predicted_length`: its output length (a distribution or a point; None:
        --default-predicted-len). `output_ids`: tokens it generated before (a request resumed
        after a restart continues after them as if never interrupted). `grammar`: the
        LoadedGrammar its output must match (pipellm.shared.grammar), or None. `priority`: lower is
        served first (--scheduling-policy priority or predicted). Raises InvalidParams if this
        engine cannot serve it."""
        params = self._checked(prompt_ids, params, output_ids)
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self.requests:
            raise InvalidParams("request_id", f"request id {rid!r} is already in use")
        if not isinstance(predicted_length, LengthDist):
            predicted_length = LengthDist.point(predicted_length
                                                or self.config.default_predicted_len)
        stop = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop.update(self.model_config.eos_token_ids)
        seq = Sequence(
            request_id=rid, token_ids=[*prompt_ids, *output_ids], params=params,
            seed=params.seed if params.seed is not None else secrets.randbits(63),
            max_len=min(len(prompt_ids) + params.max_tokens, self.max_model_len),
            predicted_length=predicted_length, stop_ids=frozenset(stop), num_prompt=len(prompt_ids),
            priority=priority,
            grammar=None if grammar is None else GrammarState(
                grammar, list(output_ids), _reasoning_gate(params)),
        )
        if params.beam_width:
            if not getattr(self.runner, "scores_tokens", True):
                raise InvalidParams("use_beam_search", "the simulated backend computes no "
                                    "log-probabilities: beam search needs a model")
            seq.beams = _beam_search(seq, grammar, output_ids)
        try:
            self.scheduler.add(seq)
        except ValueError as e:
            raise InvalidParams("max_tokens", str(e)) from None
        self.requests[rid] = seq
        self._added += 1
        return rid

    def _checked(self, prompt_ids: list[int], params: SamplingParams,
                 output_ids: list[int]) -> SamplingParams:
        """`params` with max_tokens fitted to the context where unset; InvalidParams where the
        request's ids, adapter or lengths are not this engine's to serve."""
        if not prompt_ids:
            raise InvalidParams("prompt", "prompt must contain at least one token")
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in prompt_ids):
            raise InvalidParams("prompt", f"token ids must be in [0, {vocab})")
        if any(t >= vocab for t, _ in params.logit_bias):
            raise InvalidParams("logit_bias", f"logit_bias token ids must be in [0, {vocab})")
        if any(t >= vocab for t in params.allowed_token_ids):
            raise InvalidParams("allowed_token_ids", f"allowed_token_ids must be in [0, {vocab})")
        if params.lora_name and params.lora_name not in self.adapters.names:
            raise InvalidParams("model", f"The model `{params.lora_name}` does not exist.")
        if len(prompt_ids) >= self.max_model_len:
            raise InvalidParams("prompt", f"prompt has {len(prompt_ids)} tokens; the context "
                                f"length is {self.max_model_len}")
        if params.max_tokens is None:  # up to the context
            params = params.fit_context(len(prompt_ids), self.max_model_len)
        if any(not 0 <= t < vocab for t in output_ids) or len(output_ids) >= params.max_tokens:
            raise InvalidParams("output_ids", "resumed output must be token ids, fewer than "
                                "max_tokens")
        return params

    def abort(self, request_id: str) -> bool:
        seq = self.requests.pop(request_id, None)
        if self.lengths is not None:
            self.lengths.forget(request_id)
        if seq is None or seq.status is SeqStatus.FINISHED:
            return False
        self.scheduler.abort(seq)
        return True

    def has_work(self) -> bool:
        return self.scheduler.has_work() or self._inflight is not None

    def tick(self) -> None:
        """The work between steps that no request waits for (the length heads' syncs): every
        step does it, and an idle server between polls."""
        if self.lengths is not None:
            self.lengths.tick()
        if self.adapters.unloading:
            self.adapters.release(self._adapters_used())

    def step(self) -> StepResult:
        """Schedule and launch one merged step; return the tokens committed meanwhile: this
        step's, or with the overlap schedule the step's before it."""
        self.tick()
        result = StepResult([], [])
        if self._inflight and any(s.beams is not None for s in self._inflight[0].sampled):
            self._commit(result)  # its results pick the beams the next step runs
        step = self.scheduler.schedule()
        result.admitted.extend(s.request_id for s in step.admitted)
        result.cached_tokens.extend(s.cached_tokens for s in step.admitted)
        tokens = step.num_tokens
        if self._inflight and (not tokens or _reads_token_values(step)):
            self._commit(result)
        if tokens:
            prev = self._inflight[1] if self._inflight else None
            start = time.perf_counter()
            launched = (step, self.runner.launch(step, prev))
            self.counts.add_step(step, tokens, time.perf_counter() - start)
            self.scheduler.advance(step)
            if self._inflight:
                self._commit(result)
            self._inflight = launched
            if not self.overlap:
                self._commit(result)
        return result

    def _commit(self, result: StepResult) -> None:
        """Wait for the step in flight and apply its results; its records go into `result`."""
        step, handle = self._inflight
        self._inflight = None
        start = time.perf_counter()
        sample = handle.result()
        self.counts.wait_s += time.perf_counter() - start
        if self.lengths is not None and sample.probes is not None:
            self._observe_lengths(step, sample)
        done = self.scheduler.commit(step, sample)
        for record in done.outputs:
            if record.finish_reason is not None:
                seq = self.requests.pop(record.request_id, None)  # a beam search: n records
                if seq is not None and self.lengths is not None:
                    self.lengths.finished(seq)
        result.outputs.extend(done.outputs)
        result.prompt.extend(done.prompt)
        self.counts.generated += sum(len(r.token_ids) for r in done.outputs)

    def _observe_lengths(self, step: ScheduledStep, sample) -> None:
        """Hand the length refiner the checkpoint rows the runner probed (StepSample)."""
        checkpoints, rows = [], step.rows
        for row, probe in zip(sample.probe_rows, sample.probes, strict=True):
            seq = rows[row][0].seq
            generated = rows[row][0].token_index - seq.num_prompt  # output before this token
            if seq.status is not SeqStatus.FINISHED:
                checkpoints.append((seq, generated, probe))
        self.lengths.observe(checkpoints)

    def stats(self) -> EngineStats:
        s, cache = self.scheduler, self.kv.prefix_cache
        prefix = {} if cache is None else dict(
            prefix_queries=cache.stats.query_tokens, prefix_hits=cache.stats.hit_tokens,
            prefix_cached=cache.slots, prefix_evictions=cache.stats.evictions)
        return EngineStats(
            capacity=self.kv.capacity, reserved=self.kv.reserved(),
            used=s.used_slots(), running=len(s.running), waiting=len(s.waiting),
            moves=self.kv.stats.moves, grows_in_place=self.kv.stats.grows_in_place,
            preemptions=s.stats.preemptions, demand=self.scheduler.demand(),
            prefill=prefill_backlog(s), step_tokens=self.config.scheduler.max_batched_tokens,
            requests=self._added, tokens=self.counts.generated, **prefix,
            **_speculation(s.speculation))

    def unload_lora(self, name: str) -> None:
        """Stop serving adapter `name` (lora/adapters.py: its running requests finish with it)."""
        self.adapters.unload(name, self._adapters_used())

    def _adapters_used(self) -> set[str]:
        """The adapters of the requests held and of the step in flight."""
        used = {s.params.lora_name for s in self.requests.values()}
        if self._inflight is not None:
            used |= {item.seq.params.lora_name for item in self._inflight[0].items}
        return used

    def lora_info(self) -> dict[str, str]:
        """vLLM's lora_requests_info labels (lora/adapters.py); {} without --enable-lora."""
        if not self.config.enable_lora:
            return {}
        s = self.scheduler
        return self.adapters.info(s.running, s.waiting, self.config.max_loras)

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                 ) -> list[Sequence]:
        """Run prompts to completion; returns their finished sequences, in prompt order."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        rids = [self.add_request(p, sp) for p, sp in zip(prompts, plist, strict=True)]
        seqs = [self.requests[r] for r in rids]
        while self.has_work():
            self.step()
        return seqs


def prefill_backlog(scheduler: Scheduler) -> int:
    """Prompt tokens `scheduler` holds not yet prefilled: the rest of the running requests'
    prompts and the waiting requests' tokens (before any prefix-cache hit). A prompt routed
    there now is prefilled after them (FCFS), so its first token waits for them."""
    return sum(max(s.num_prompt - s.num_cached, 0) for s in scheduler.running) + \
        sum(s.pending for s in scheduler.waiting)


def _beam_search(seq: Sequence, grammar, output_ids) -> BeamSearch:
    """seq's beam search (SamplingParams.beam_width); InvalidParams where it cannot run."""
    p = seq.params
    if grammar is not None:
        raise InvalidParams("use_beam_search", "beam search cannot follow a grammar "
                            "(response_format, tools)")
    if output_ids:
        raise InvalidParams("use_beam_search", "a beam search cannot be resumed mid-way")
    return BeamSearch(p.beam_width, seq.max_len - seq.num_prompt, seq.stop_ids,
                      p.length_penalty, p.early_stopping)


def _speculation(speculation) -> dict:
    """EngineStats' speculative counters (none without speculation)."""
    if speculation is None:
        return {}
    return dict(spec_draft_tokens=speculation.draft_tokens,
                spec_accepted_tokens=speculation.accepted_tokens)


def _reads_token_values(step: ScheduledStep) -> bool:
    """Whether launching `step` reads sampled token values on the host (penalties count them,
    a grammar's mask follows them), so that it cannot be launched before the step in flight is
    committed."""
    return any(s.params.reads_output or s.grammar is not None for s in step.sampled)


def _reasoning_gate(params: SamplingParams) -> ReasoningGate | None:
    """Where a reasoning model's grammar starts: after its end marker. An opening marker must
    be one token (Qwen3's and DeepSeek-R1's are): the grammar cannot follow an opening of
    several that turns out not to be one, so such a grammar constrains the whole output."""
    if not params.thinking_end_ids or len(params.thinking_start_ids) > 1:
        return None
    return ReasoningGate(params.thinking_start_ids, params.thinking_end_ids)
