"""Compute without its sockets: requests and aborts in, StepOutputs out.

`ComputeService` wraps it with zmq, heartbeats and Redis; `pipellm run-batch` drives it in
process, so both admit, refuse, abort and name choices alike. Invariants: a request has a route
from its admission until it finishes or is aborted; a beam search's outputs (its n best, best
first) come named as its choices; an abort that overtakes its request is kept
`EARLY_ABORT_TTL_S` and drops the request when it arrives.
"""

from __future__ import annotations

import time
from dataclasses import replace

from pipellm.services.compute.engine import LLMEngine
from pipellm.services.compute.structured import GrammarQueue
from pipellm.shared.choice import ChoiceId, api_id
from pipellm.shared.length_dist import LengthDist
from pipellm.shared.messages import GenerateRequest, RequestError, Route, StepOutput, Tokens
from pipellm.shared.sampling import InvalidParams

EARLY_ABORT_TTL_S = 60.0


def choice_ids(req: GenerateRequest) -> list[str]:
    """The choices a request answers: itself, or a beam search's n choices of its API id."""
    if not req.params.beam_width:
        return [req.request_id]
    first = ChoiceId.parse(req.request_id)
    return [str(first._replace(index=first.index + i)) for i in range(req.params.beam_n)]


class ComputeCore:
    """The engine's front: admission (after a grammar compiles, off the loop), aborts, and
    each step's StepOutput with the routes of the requests it admitted."""

    def __init__(self, engine: LLMEngine, grammars: GrammarQueue | None = None):
        """`grammars`: the compile queue, else made at the first request with a grammar."""
        self.engine, self.grammars = engine, grammars
        self.routes: dict[str, Route] = {}  # live requests
        self.beam_choices: dict[str, list[str]] = {}  # beam search: its choices' ids
        self.early_aborts: dict[str, float] = {}  # aborts that overtook their request
        self._errors: list[RequestError] = []  # not yet sent
        self._aborted: list[str] = []  # choice ids aborted, not yet sent

    def has_work(self) -> bool:
        return self.engine.has_work()

    def compiling(self) -> bool:
        """Whether a request waits for its grammar."""
        return self.grammars is not None and bool(self.grammars.waiting)

    def submit(self, req: GenerateRequest) -> None:
        """Admit `req` now, or once its grammar compiled (`notices`)."""
        if req.grammar is not None:
            self.grammars = self.grammars or GrammarQueue(self.engine.config.model)
            self.grammars.submit(req.grammar, req)
        else:
            self._admit(req, None)

    def abort(self, request_id: str) -> None:
        """End a request, given its id or its API id (every choice); one not here yet is
        dropped when it arrives."""
        ids = [r for r in self.routes if r == request_id or api_id(r) == request_id]
        for rid in ids:
            self.engine.abort(rid)
            self.routes.pop(rid, None)
            self._aborted.extend(self.beam_choices.pop(rid, [rid]))
        if not ids:
            self.early_aborts[request_id] = time.monotonic()

    def notices(self) -> StepOutput | None:
        """Admits the requests whose grammar compiled; the refusals and aborts since the last
        call as one StepOutput, or None when there are none."""
        for req, grammar in self.grammars.ready() if self.grammars is not None else ():
            self._admit(req, grammar)
        if not (self._errors or self._aborted):
            return None
        out = StepOutput([], errors=self._errors, aborted=self._aborted, step_time=time.time())
        self._errors, self._aborted = [], []
        return out

    def step(self) -> StepOutput:
        """One engine step as the detokenizer takes it."""
        result = self.engine.step()
        # a route goes with every admission (a preempted request's again: harmless)
        routes = [replace(self.routes[r], request_id=c, cached_tokens=n)
                  for r, n in zip(result.admitted, result.cached_tokens, strict=True)
                  if r in self.routes for c in self.beam_choices.get(r, [r])]
        outputs = self._name_beams(result.outputs)
        for t in result.outputs:
            if t.finish_reason is not None:
                self.routes.pop(t.request_id, None)
                self.beam_choices.pop(t.request_id, None)
        return StepOutput(routes, outputs, result.prompt, step_time=time.time())

    def expire_early_aborts(self) -> None:
        now = time.monotonic()
        self.early_aborts = {k: t for k, t in self.early_aborts.items()
                             if now - t < EARLY_ABORT_TTL_S}

    def _admit(self, req: GenerateRequest, grammar) -> None:
        """Into the engine, unless aborted meanwhile; `grammar`: its LoadedGrammar, or the
        error that its compile raised (a GrammarError: the client's 400)."""
        rid = req.request_id
        if self.early_aborts.pop(rid, None) or self.early_aborts.pop(api_id(rid), None):
            return
        try:
            if isinstance(grammar, Exception):
                raise grammar
            predicted = LengthDist(tuple(req.predicted_length)) if req.predicted_length else None
            self.engine.add_request(list(req.prompt_ids), req.params, rid, predicted,
                                    list(req.output_ids), grammar, req.priority)
        except (InvalidParams, ValueError, RuntimeError, ImportError) as e:  # GrammarError: 400
            self._errors.append(RequestError(rid, req.route.reply_to, str(e),
                                             getattr(e, "param", None)))
            return
        self.routes[rid] = req.route
        if req.params.beam_width:
            self.beam_choices[rid] = choice_ids(req)

    def _name_beams(self, outputs: list[Tokens]) -> list[Tokens]:
        """A finished beam search's records (its n best, best first) named as its choices."""
        named, seen = [], {}
        for t in outputs:
            choices = self.beam_choices.get(t.request_id)
            if choices is not None:
                i = seen[t.request_id] = seen.get(t.request_id, -1) + 1
                t = replace(t, request_id=choices[i])
            named.append(t)
        return named
