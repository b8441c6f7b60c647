"""One request's state inside compute: its tokens, how many have KV in cache, and its KV segment."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol

from pipellm.shared.length_dist import LengthDist
from pipellm.shared.sampling import SamplingParams

UNSAMPLED = -1  # a token_ids entry whose step is in flight: its value is still on the device


class GrammarLike(Protocol):
    """What a sequence needs of its grammar (structured.GrammarState)."""

    def accept(self, token: int) -> None: ...

    def valid_prefix(self, tokens: list[int]) -> int: ...

    @property
    def done(self) -> bool: ...


class BeamsLike(Protocol):
    """What a sequence needs of its beam search (beam.search.BeamSearch)."""

    width: int  # beams, each in a lane of max_len slots
    k: int  # candidates each of its rows returns


class SeqStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """Invariants: token_ids = prompt + generated; token_ids[:num_cached] have K/V in the slots
    [kv_start, kv_start + num_cached) (or will have, once the steps in flight ran) and
    num_cached <= kv_reserved while RUNNING; the tokens token_ids[num_cached:] are pending (fed
    to the model in a later step). A generated token is UNSAMPLED from the step that samples it
    being scheduled until that step's result is committed (`fill`): at most the last one or two
    (the step in flight and the one being built)."""

    request_id: str
    token_ids: list[int]
    params: SamplingParams
    seed: int
    max_len: int  # prompt + max_tokens, capped by the model's context length
    predicted_length: LengthDist  # of its output, in tokens (sizes the KV segment)
    stop_ids: frozenset[int]  # EOS (unless ignore_eos) and stop_token_ids
    num_prompt: int = -1  # token_ids[:num_prompt] is the prompt (-1: all of token_ids)
    num_cached: int = 0
    kv_start: int = -1
    kv_reserved: int = 0
    admit_order: int = -1
    cached_tokens: int = 0  # prompt tokens whose K/V a prefix cache hit gave at first admission
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: str | None = None
    peak_total: int = 0  # the scheduler's cached output-length bound for admission (0: unset)
    priority: int = 0  # lower is served first (--scheduling-policy priority or predicted)
    arrival: float | None = None  # on the scheduler's clock, set when it is added
    preemptions: int = 0  # times it was preempted (re-admission boost; scheduling/policy.py)
    logprobs: list[float] = field(default_factory=list)  # of the tokens this engine generated
    # with params.prompt_logprobs: of token_ids[1 : 1 + len(prompt_logprobs)]
    prompt_logprobs: list[float] = field(default_factory=list)
    grammar: GrammarLike | None = None  # structured output: its matcher (compute/structured.py)
    # beam search (pipellm/services/compute/beam/): its search; its segment holds one lane of
    # max_len slots per beam, and token_ids holds the prompt then the best running beam's tokens
    beams: BeamsLike | None = None

    def __post_init__(self):
        if self.num_prompt < 0:
            self.num_prompt = len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.num_prompt

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt :]

    @property
    def prompt_logprobs_owed(self) -> range:
        """Prompt positions whose logprobs are still to be computed (none unless asked for)."""
        if self.params.prompt_logprobs is None:
            return range(0)
        return range(1 + len(self.prompt_logprobs), self.num_prompt)

    @property
    def top_count(self) -> int:
        """How many most likely tokens its rows return: the K candidates of a beam search,
        else the top_logprobs asked for."""
        return self.params.top_logprobs if self.beams is None else self.beams.k

    @property
    def kv_extent(self) -> int:
        """Slots from kv_start that hold its K/V (what a move of its segment copies): the
        first num_cached, in each beam lane with beam search."""
        if self.beams is None:
            return self.num_cached
        return (self.beams.width - 1) * self.max_len + self.num_cached

    @property
    def pending(self) -> int:
        return len(self.token_ids) - self.num_cached

    @property
    def at_limit(self) -> bool:
        """Whether the token last scheduled is its last by length: no further step may run it."""
        return self.num_output >= self.params.max_tokens or self.num_tokens >= self.max_len

    def append(self, token: int, logprob: float) -> None:
        self.token_ids.append(UNSAMPLED)
        self.fill(len(self.token_ids) - 1, token, logprob)

    def fill(self, index: int, token: int, logprob: float) -> None:
        """Commit the sampled value of token_ids[index] (the oldest UNSAMPLED one). If it
        finishes the request, the tokens scheduled after it are dropped."""
        self.token_ids[index] = token
        self.logprobs.append(logprob)
        if self.grammar is not None:
            self.grammar.accept(token)
        self.finish_reason = self._finish_reason(token, index + 1)
        if self.finish_reason is not None:
            del self.token_ids[index + 1 :]

    def _finish_reason(self, token: int, length: int) -> str | None:
        """Why a request whose token_ids[length - 1] is `token` ends there, if it does."""
        num_output = length - self.num_prompt
        if self.grammar is not None and self.grammar.done:  # complete: it ends on EOS
            return "stop"
        if token in self.stop_ids and num_output > self.params.min_tokens:
            return "stop"
        if num_output >= self.params.max_tokens or length >= self.max_len:
            return "length"
        return None
