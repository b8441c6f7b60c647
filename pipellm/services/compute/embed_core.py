"""The pooling runner's requests in compute: EmbedRequests in, EmbedResults out.

Requests queue as they arrive and run between engine steps, a forward's worth at a time: the
oldest requests up to the budget of one pooling forward (at least one request; pooling's
forward_budget), so that each answer leaves as soon as its forward is done and new requests
join the next one. Of those, all that ask for the same task, width and normalization go through
`LLMEngine.embed` (or `classify`: the scoring head's logits; `reward`: every token's reward head
output, a row per token) together. Should a joined run fail (an input the tokenizer let
through that the engine refuses), each request of it runs alone, so only the bad one gets the
error. Errors: InvalidParams is a 400 on its field; no room in the
KV cache for an input (NoKVRoom) a 400 on `input`; anything else a 500, logged. Never raises.
"""

from __future__ import annotations

import logging
from array import array

import numpy as np

from pipellm.services.compute.engine import LLMEngine
from pipellm.services.compute.pooling import NoKVRoom, forward_budget
from pipellm.shared.messages import EmbedRequest, EmbedResult
from pipellm.shared.sampling import InvalidParams

log = logging.getLogger(__name__)


class EmbedCore:
    def __init__(self, engine: LLMEngine, budget: int | None = None):
        """`budget`: the prompt tokens a run takes (None: the engine's forward_budget)."""
        self.engine = engine
        self.budget = forward_budget(engine) if budget is None else budget
        self.queue: list[EmbedRequest] = []

    def submit(self, req: EmbedRequest) -> None:
        self.queue.append(req)

    def has_work(self) -> bool:
        return bool(self.queue)

    def run(self) -> list[tuple[str, EmbedResult]]:
        """(reply address, result) of the oldest queued requests up to the budget, in arrival
        order per task and width; the rest stay queued."""
        by_width: dict[tuple, list[EmbedRequest]] = {}
        for req in self._take():
            by_width.setdefault((req.task, req.dimensions, req.use_activation), []).append(req)
        out = []
        for group in by_width.values():
            results = self._run(group)
            if len(group) > 1 and any(r.error is not None for r in results):
                results = [self._run([req])[0] for req in group]
            out.extend((req.reply_to, r) for req, r in zip(group, results, strict=True))
        return out

    def _take(self) -> list[EmbedRequest]:
        """The oldest queued requests whose inputs fit the budget (the first one always)."""
        tokens, n = 0, 0
        for req in self.queue:
            tokens += sum(len(ids) for ids in req.inputs)
            if n and tokens > self.budget:
                break
            n += 1
        taken, self.queue = self.queue[:n], self.queue[n:]
        return taken

    def _run(self, group: list[EmbedRequest]) -> list[EmbedResult]:
        """The results of `group` (one width) from one embed call; on a failure, each the
        same error."""
        prompts = [list(ids) for req in group for ids in req.inputs]
        try:
            if group[0].task == "classify":
                vectors = self.engine.classify(prompts)
            elif group[0].task == "reward":
                vectors = self.engine.reward(prompts)
            else:
                vectors = self.engine.embed(prompts, group[0].dimensions or None,
                                            group[0].use_activation)
            return _results(group, np.ascontiguousarray(vectors.numpy(), dtype=np.float32))
        except InvalidParams as e:
            return [_error(req, str(e), 400, e.param) for req in group]
        except NoKVRoom as e:  # an input over the KV cache's free slots
            return [_error(req, f"{e} (this server's --kv-cache-tokens)", 400, "input")
                    for req in group]
        except Exception:
            log.exception("embeddings failed for %s", ", ".join(r.request_id for r in group))
            return [_error(req, "internal error in compute", 500, None) for req in group]


def _results(group: list[EmbedRequest], rows: np.ndarray) -> list[EmbedResult]:
    """Each request's rows of `rows` [inputs of the group, dim] as its EmbedResult (task
    reward: [tokens of the group, dim], a row per token)."""
    out, at = [], 0
    for req in group:
        n = sum(len(ids) for ids in req.inputs) if req.task == "reward" else len(req.inputs)
        flat = array("f")
        flat.frombytes(rows[at:at + n].tobytes())
        out.append(EmbedResult(req.request_id, flat, rows.shape[1],
                               array("i", (len(ids) for ids in req.inputs))))
        at += n
    return out


def _error(req: EmbedRequest, message: str, status: int, param: str | None) -> EmbedResult:
    return EmbedResult(req.request_id, error=message, error_status=status, error_param=param)
