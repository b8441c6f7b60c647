"""Constrained decoding in compute: grammars compiled off the loop (`GrammarQueue`), one
xgrammar matcher per sequence (`GrammarState`), the step's token bitmask (`start_mask`,
`mask_logits`). A matcher advances only when the host learns a token (`Sequence.fill`), so a
step with a grammar row waits for the step before it to be committed. A complete grammar
accepts only EOS: the sequence ends with "stop" whatever ignore_eos says.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from pipellm.kernels.token_bitmask import apply_token_bitmask
from pipellm.shared.grammar import BackgroundCompiler, GrammarSpec, LoadedGrammar

log = logging.getLogger("pipellm.compute")


class GrammarQueue:
    """Requests waiting for their grammar. One thread compiles (xgrammar releases the GIL, so
    the loop steps meanwhile; a cached grammar comes back at once); the compiler itself is
    built in the background from start-up (BackgroundCompiler), which compute waits for before
    it reports ready: its imports would hold the GIL through the first requests."""

    def __init__(self, model: str):
        self.compiler = BackgroundCompiler(model)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar")
        self.waiting: list[tuple[Future, object]] = []

    def submit(self, spec: GrammarSpec, item) -> None:
        self.waiting.append((self._pool.submit(lambda: self.compiler.get().compile(spec)), item))

    def ready(self) -> list[tuple[object, LoadedGrammar | Exception]]:
        """(item, its grammar or why it has none) of every compile that finished, in order."""
        done = [(f, item) for f, item in self.waiting if f.done()]
        self.waiting = [(f, item) for f, item in self.waiting if not f.done()]
        return [(item, f.exception() or f.result()) for f, item in done]


class ReasoningGate:
    """Where a reasoning model's output leaves its reasoning, token by token: the grammar
    applies only after. `start` empty: the output starts in the reasoning; else it reasons only
    if it opens with `start` (while it may still, `opening` is how many of its tokens came)."""

    def __init__(self, start: tuple[int, ...], end: tuple[int, ...]):
        self.start, self.end = start, end
        self.opening = 0 if start else None
        self.tail: list[int] = []  # the reasoning's last tokens (an end marker in progress)
        self.passed = False

    def feed(self, token: int) -> list[int]:
        """Take the next output token; returns the tokens the grammar must now take (the ones
        of an opening that turned out not to be one, then this one), [] while reasoning."""
        if self.passed:
            return [token]
        if self.opening is not None:
            if token == self.start[self.opening]:
                self.opening += 1
                if self.opening == len(self.start):
                    self.opening = None  # opened: reasoning from here
                return []
            self.passed = True  # no reasoning: the grammar takes all of it
            return [*self.start[: self.opening], token]
        self.tail = (self.tail + [token])[-len(self.end):]
        self.passed = self.tail == list(self.end)
        return []


class GrammarState:
    """A sequence's position in its grammar (xgrammar GrammarMatcher) of a LoadedGrammar; with
    a ReasoningGate, the grammar starts once the reasoning has ended."""

    def __init__(self, grammar: LoadedGrammar, replay: list[int] = (),
                 gate: ReasoningGate | None = None):
        import xgrammar as xgr

        self.matcher = xgr.GrammarMatcher(grammar.compiled)
        # int32 [ceil(vocab / 32)] or None; numpy: the fill thread runs no torch op
        self.allowed = None if grammar.allowed is None else grammar.allowed.numpy()
        self.vocab_size = grammar.compiled.tokenizer_info.vocab_size
        self.rejected = False
        self.gate = gate
        for token in replay:
            self.accept(token)

    @property
    def reasoning(self) -> bool:
        return self.gate is not None and not self.gate.passed

    def accept(self, token: int) -> None:
        """Advance by the committed `token` (past the reasoning); a token the grammar forbids
        (which the mask makes impossible) ends the sequence rather than the process."""
        for t in self.gate.feed(token) if self.gate is not None else [token]:
            self._accept(t)

    def _accept(self, token: int) -> None:
        if not self.rejected and not self.matcher.accept_token(token):
            log.warning("token %d is not allowed by the request's grammar: ending it", token)
            self.rejected = True

    @property
    def done(self) -> bool:
        """Whether the output is complete (terminated) or cannot go on (rejected)."""
        return self.rejected or (not self.reasoning and self.matcher.is_terminated())

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of `tokens`, in order, the grammar accepts from here (it stays here);
        none while reasoning (no drafts then)."""
        if self.reasoning:
            return 0
        n = 0
        while n < len(tokens) and not self.rejected and self.matcher.accept_token(tokens[n]):
            n += 1
        if n:
            self.matcher.rollback(n)
        return n

    def fill_rows(self, bitmask: np.ndarray, first: int, drafts: list[int]) -> None:
        """Rows first .. first + len(drafts) of the bitmask: the tokens allowed next, then
        after each draft in turn (all in the grammar: valid_prefix); it stays here."""
        for j, token in enumerate([None, *drafts]):
            if token is not None:
                self.matcher.accept_token(token)
            self.fill(bitmask, first + j)
        if drafts:
            self.matcher.rollback(len(drafts))

    def fill(self, bitmask: np.ndarray, row: int) -> None:
        """Row `row` of the step's bitmask int32 [S, ceil(vocab / 32)]: the tokens allowed
        next (all while reasoning; before a possible opening, the grammar's and its next
        token)."""
        if self.reasoning and self.gate.opening is None:
            bitmask[row] = -1
            return
        self.matcher.fill_next_token_bitmask(bitmask, row)
        if self.allowed is not None:
            bitmask[row] &= self.allowed
        if self.reasoning:  # the opening's next token stays possible
            token = self.gate.start[self.gate.opening]
            bitmask.view(np.uint32)[row, token >> 5] |= np.uint32(1 << (token & 31))


_FILLER = ThreadPoolExecutor(1, thread_name_prefix="grammar-mask")


def start_mask(seqs: list, drafts: dict | None = None) -> Future | None:
    """The bitmask int32 [S, ceil(vocab / 32)] of the grammar rows of `seqs` (one per sampled
    row; a speculative verify's k + 1 rows in a row, `drafts`: {seq: its drafts}), filled in
    a thread; None when no row has a grammar. The matchers must stay put until it is done
    (the step's sampling waits for it). The thread runs no torch op: one would start an
    OpenMP team of its own beside the forward pass's, measured to slow every later step by
    ~25% on 2 cores."""
    drafts = drafts or {}
    firsts = {}  # each grammar sequence's first row
    for i, s in enumerate(seqs):
        if s.grammar is not None:
            firsts.setdefault(s, i)
    if not firsts:
        return None
    words = (next(iter(firsts)).grammar.vocab_size + 31) // 32
    bitmask = np.full((len(seqs), words), -1, dtype=np.int32)  # all allowed (xgrammar's)

    def fill() -> np.ndarray:
        for s, first in firsts.items():
            s.grammar.fill_rows(bitmask, first, drafts.get(s, []))
        return bitmask

    return _FILLER.submit(fill)


def mask_logits(logits: torch.Tensor, seqs: list, mask: Future | None = None) -> torch.Tensor:
    """logits [S, vocab] float with the grammar rows' forbidden tokens at -inf, in place (the
    caller passes a copy where the model's logits must stay: logprobs). `mask`: start_mask's
    for these rows (started here if None). Tokens past the grammar's vocabulary (padding rows
    of the LM head) are forbidden too."""
    rows = [i for i, s in enumerate(seqs) if s.grammar is not None]
    vocab = seqs[rows[0]].grammar.vocab_size
    bitmask = torch.from_numpy((mask or start_mask(seqs)).result())
    if logits.shape[-1] > vocab:
        logits[rows, vocab:] = float("-inf")
    apply_token_bitmask(logits[:, :vocab], bitmask, rows)
    return logits
