"""Requests this gateway owns, the routing of incoming deltas to them, and their resumption.

The gateway holds each request's HTTP connection, so what its client already has (tokens and
text per choice) lives here, exactly as long as the stream can still be continued. When a
restart of compute, the detokenizer or a tokenizer lost requests, `Registry.resume` turns that
into Resume messages: the choice continues under a new attempt id (pipellm/shared/choice.py), and
deltas of an older attempt that arrive late are dropped.
"""

from __future__ import annotations

import asyncio
import time
from array import array
from dataclasses import dataclass, field, replace

from pipellm.services.gateway.responses import TokenLogprob
from pipellm.shared.choice import ChoiceId, api_id
from pipellm.shared.messages import Delta, DeltaBatch, Resume, TokenizeRequest, Tokens

MAX_RESUMES = 3  # a request whose services keep dying is failed after this many resumptions


@dataclass
class ChoiceState:
    """One choice as its client has it so far."""

    index: int
    attempt: int = 0
    text: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)  # with a reasoning parser
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_string: str | None = None  # the stop string that ended it (finish_reason "stop")
    cum_logprob: float = 0.0  # of its generated tokens (best_of ranks choices by it)
    num_prompt: int = 0
    cached_tokens: int = 0  # of the prompt's, from the prefix cache
    last: float = 0.0  # monotonic time of the last delta, for inter-token latency
    sent_role: bool = False
    prompt_ids: array | None = None  # its prompt's ids, when asked for (return_token_ids)
    prompt_tokens: Tokens | None = None  # its prompt's logprobs, when asked for
    sent_prompt_ids: bool = False

    def add(self, delta: Delta, entries: list[TokenLogprob]) -> None:
        """Take in the choice's next delta (`entries`: its logprob entries, if asked for)."""
        self.text.append(delta.text)
        if delta.reasoning:
            self.reasoning.append(delta.reasoning)
        self.token_ids.extend(delta.token_ids)
        self.cum_logprob += sum(delta.logprobs)
        self.logprobs.extend(entries)
        self.num_prompt = delta.num_prompt
        self.cached_tokens = max(self.cached_tokens, delta.cached_tokens)
        if delta.prompt_ids is not None:
            self.prompt_ids = delta.prompt_ids
        if delta.prompt is not None:
            self.prompt_tokens = delta.prompt
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason
            self.stop_string = delta.stop_string

    @property
    def id_suffix(self) -> str:
        return str(ChoiceId("", self.index, self.attempt))


@dataclass
class Inflight:
    """One API request. `deltas` receives its choices' Deltas; `tokenize` is what was sent to
    the tokenizers (sent again, with `resume`, to continue after a restart)."""

    request_id: str
    n: int
    arrival: float = field(default_factory=time.time)  # wall clock, as compute and Redis see
    start: float = field(default_factory=time.monotonic)
    deltas: asyncio.Queue = field(default_factory=asyncio.Queue)
    choices: list[ChoiceState] = field(default_factory=list)
    tokenize: list[TokenizeRequest] = field(default_factory=list)  # one per prompt
    resumes: int = 0

    def __post_init__(self):
        self.choices = [ChoiceState(i) for i in range(self.n)]

    @property
    def got_output(self) -> bool:
        return any(c.token_ids for c in self.choices)

    def fail(self, message: str, status: int = 503) -> None:
        self.deltas.put_nowait(Delta(self.request_id, error=message, error_status=status))


class Registry:
    def __init__(self):
        self.requests: dict[str, Inflight] = {}

    def __len__(self) -> int:
        return len(self.requests)

    def add(self, request_id: str, n: int) -> Inflight:
        req = self.requests[request_id] = Inflight(request_id, n)
        return req

    def remove(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    def dispatch(self, batch: DeltaBatch) -> None:
        for delta in batch.deltas:
            req = self.requests.get(api_id(delta.request_id))
            if req is None:  # its client is gone
                continue
            if delta.request_id != req.request_id:  # a choice's: is it its current attempt?
                _, index, attempt = ChoiceId.parse(delta.request_id)
                if index >= req.n or req.choices[index].attempt != attempt:
                    continue
            req.deltas.put_nowait(delta)

    def fail(self, message: str) -> list[str]:
        """End every request with a 503 error; returns their ids."""
        for req in self.requests.values():
            req.fail(message)
        return list(self.requests)

    def resume(self, only_without_output: bool, keep=None) -> list[
            tuple[Inflight, list[TokenizeRequest], list[str]]]:
        """Continue the requests a restart lost (only those without output yet: a tokenizer's
        restart; the others passed it; with `keep`, only the ids it holds). Per request: what
        to send the tokenizers (none: it failed after MAX_RESUMES, or its choices all had their
        tokens) and the choice ids of the lost attempts (to abort in compute, where they may
        still run)."""
        out = []
        for req in self.requests.values():
            if not req.tokenize or (only_without_output and req.got_output) or \
                    (keep is not None and req.request_id not in keep):
                continue
            lost = [req.request_id + c.id_suffix for c in req.choices if c.finish_reason is None]
            if req.resumes >= MAX_RESUMES:
                req.fail(f"the request was lost {req.resumes + 1} times by restarting services")
                out.append((req, [], lost))
                continue
            req.resumes += 1
            again = []
            for tokenize in req.tokenize:  # each prompt's unfinished choices
                first = tokenize.first_choice
                resumes = []
                for c in req.choices[first : first + tokenize.n]:
                    if c.finish_reason is None:
                        c.attempt += 1
                        resumes.append(self._resume_choice(req, tokenize, c))
                resumes = [r for r in resumes if r is not None]
                if resumes:
                    again.append(replace(tokenize, resume=resumes))
            out.append((req, again, lost))
        return out

    @staticmethod
    def _resume_choice(req: Inflight, tokenize: TokenizeRequest, c: ChoiceState
                       ) -> Resume | None:
        """The Resume of choice c, or None when it had all its tokens (it finishes here)."""
        limit = tokenize.params.max_tokens  # None: the context's (compute knows it)
        if limit is not None and len(c.token_ids) >= limit:
            req.deltas.put_nowait(Delta(req.request_id + c.id_suffix, finish_reason="length",
                                        num_prompt=c.num_prompt))
            return None
        return Resume(c.index, c.attempt, array("i", c.token_ids),
                      sum(map(len, c.text)) + sum(map(len, c.reasoning)))
