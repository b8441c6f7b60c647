"""Resuming choices a restart lost: the gateway's bookkeeping, the detokenizer's replay, and the
stream that cannot be resumed ending with an error event the OpenAI client raises."""

from __future__ import annotations

import asyncio
import threading
from array import array

import openai
import pytest
from aiohttp import web

from pipellm.services.detokenizer.service import Detokenizer
from pipellm.services.gateway.inflight import MAX_RESUMES, Registry
from pipellm.services.gateway.metrics import Metrics
from pipellm.services.gateway.protocol import parse_completion
from pipellm.services.gateway.stream import stream
from pipellm.shared.choice import ChoiceId, api_id
from pipellm.shared.demo_model import build_demo_tokenizer
from pipellm.shared.messages import (
    Delta,
    DeltaBatch,
    Resume,
    Route,
    StepOutput,
    TokenizeRequest,
    Tokens,
)
from pipellm.shared.redis_server import free_port
from pipellm.shared.sampling import SamplingParams


def _tokens(rid: str, ids: list[int]) -> Tokens:
    return Tokens(rid, 0, array("i", ids), array("f", [0.0] * len(ids)))

def registered(n: int = 2, max_tokens: int = 10):
    reg = Registry()
    req = reg.add("cmpl-1", n)
    req.tokenize = [TokenizeRequest("cmpl-1", "gw", SamplingParams(max_tokens=max_tokens),
                                    prompt_text="hi", n=n)]
    return reg, req


def test_resume_continues_each_unfinished_choice_under_a_new_attempt():
    reg, req = registered()
    reg.dispatch(DeltaBatch([Delta("cmpl-1:0", "ab", _tokens("cmpl-1:0", [5, 6])),
                             Delta("cmpl-1:1", "x", _tokens("cmpl-1:1", [7]),
                                   finish_reason="stop")]))
    for _ in range(2):
        d = req.deltas.get_nowait()
        c = req.choices[ChoiceId.parse(d.request_id).index]
        c.text.append(d.text)
        c.token_ids.extend(d.token_ids)
        c.finish_reason = d.finish_reason
    assert reg.resume(only_without_output=True) == []  # it has output: passed the tokenizer
    ((got, (tokenize,), lost),) = reg.resume(only_without_output=False)
    assert got is req and lost == ["cmpl-1:0"]  # choice 1 had finished
    (r,) = tokenize.resume
    assert (r.index, r.attempt, list(r.output_ids), r.sent_chars) == (0, 1, [5, 6], 2)
    assert tokenize.prompt_text == "hi" and tokenize.n == 2
    # late deltas of the lost attempt are dropped; the new attempt's pass
    reg.dispatch(DeltaBatch([Delta("cmpl-1:0", "late"), Delta("cmpl-1:0.1", "c")]))
    assert req.deltas.get_nowait().request_id == "cmpl-1:0.1" and req.deltas.empty()
    assert str(ChoiceId("cmpl-1", 0, 1)) == "cmpl-1:0.1" and str(ChoiceId("c", 2)) == "c:2"
    assert ChoiceId.parse("cmpl-1:0.1") == ("cmpl-1", 0, 1) and api_id("cmpl-1:0.1") == "cmpl-1"
    assert api_id("cmpl-1") == "cmpl-1" and ChoiceId.parse("cmpl-1") == ("cmpl-1", 0, 0)


def test_resume_gives_up_after_max_resumes_and_finishes_full_choices_itself():
    reg, req = registered(n=1, max_tokens=2)
    for _ in range(MAX_RESUMES):
        ((_, (tokenize,), _),) = reg.resume(False)
        assert tokenize.resume[0].attempt == req.choices[0].attempt
    ((_, tokenize, lost),) = reg.resume(False)
    assert tokenize == [] and lost == [f"cmpl-1:0.{MAX_RESUMES}"]
    assert req.deltas.get_nowait().error_status == 503
    reg, req = registered(n=1, max_tokens=2)
    req.choices[0].token_ids = [3, 4]  # all its tokens arrived, the final delta did not
    ((_, tokenize, _),) = reg.resume(False)
    assert tokenize == []
    d = req.deltas.get_nowait()
    assert (d.request_id, d.finish_reason) == ("cmpl-1:0.1", "length")


@pytest.mark.parametrize("stop", [[], ["quick brown", "zz"]])
def test_detokenizer_replay_continues_the_text_exactly(stop):
    """A fresh detokenizer given what the client has continues the text as the lost one
    would have, held-back text (a possible stop string) included, cut at any token."""
    tok = build_demo_tokenizer()
    prompt = tok.encode("Once upon a time").ids
    ids = tok.encode(" the quick brown fox jumps over the lazy dog, quick brown! 你好").ids

    def route(resume=None):
        return Route("r:0", "gw", len(prompt), array("i", prompt), stop=stop, resume=resume)

    def run(detok, tokens) -> tuple[list[str], str | None]:
        texts, finish = [], None
        for i, t in enumerate(tokens):
            fin = "length" if i == len(tokens) - 1 else None
            out = detok.handle(StepOutput([], [Tokens("r:0", i, array("i", [t]),
                                                      array("f", [0]), finish_reason=fin)]))
            for d in out.deltas.get("gw", []):
                texts.append(d.text)
                finish = d.finish_reason or finish
            if finish:
                break
        return texts, finish

    whole = Detokenizer(tok, 60)
    whole.handle(StepOutput([route()]))
    texts, finish = run(whole, ids)
    for cut in range(1, len(texts)):
        sent = "".join(texts[:cut])
        fresh = Detokenizer(tok, 60)
        resume = Resume(0, 1, array("i", ids[:cut]), len(sent))
        fresh.handle(StepOutput([route(resume)]))
        rest, rest_finish = run(fresh, ids[cut:])
        assert sent + "".join(rest) == "".join(texts) and rest_finish == finish, cut


class _Gateway:
    """What stream() uses of the gateway: its metrics and token strings."""

    def __init__(self):
        self.metrics = Metrics()
        self.tokenizer = build_demo_tokenizer()

    def token_text(self, t: int) -> str:
        return self.tokenizer.decode([t])


def test_a_stream_that_cannot_resume_ends_with_an_error_event_the_client_raises():
    gw, reg = _Gateway(), Registry()
    req = parse_completion({"prompt": "hi", "stream": True}, "m")

    async def handler(request):
        inflight = reg.add("cmpl-1", 1)
        inflight.deltas.put_nowait(Delta("cmpl-1:0", "Hello", _tokens("cmpl-1:0", [5])))
        inflight.fail("the compute service is down; please retry")
        return await stream(gw, request, req, inflight)

    port = free_port()
    ready = threading.Event()

    def serve():
        async def main():
            app = web.Application()
            app.router.add_post("/v1/completions", handler)
            runner = web.AppRunner(app)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", port).start()
            ready.set()
            await asyncio.sleep(30)
        asyncio.run(main())

    threading.Thread(target=serve, daemon=True).start()
    assert ready.wait(10)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
    got = []
    with pytest.raises(openai.APIError, match="compute service is down"):
        for chunk in client.completions.create(model="m", prompt="hi", stream=True):
            got.append(chunk.choices[0].text)
    assert got == ["Hello"]


def test_a_resumed_request_keeps_its_priority(demo_model_dir):
    """A request at priority 4, its first choice lost after two tokens: the resume the gateway
    sends (through the codec, as the socket carries it) and the GenerateRequest the tokenizer
    builds from it carry priority 4, under the choice's next attempt."""
    from pipellm.services.tokenizer.service import Tokenizer
    from pipellm.shared.codec import decode, encode
    from pipellm.shared.config import EngineConfig

    body = {"model": "m", "prompt": "The quick brown fox", "max_tokens": 8, "n": 2,
            "priority": 4}
    reg = Registry()
    req = reg.add("cmpl-p", 2)
    req.tokenize = parse_completion(body, "m").tokenize_requests("cmpl-p", "gw", 11, 0.0)
    req.choices[0].token_ids = [5, 6]
    ((_, (tokenize,), lost),) = reg.resume(only_without_output=False)
    assert lost == ["cmpl-p:0", "cmpl-p:1"]
    tokenize = decode(encode(tokenize))
    assert tokenize.priority == 4 and [r.attempt for r in tokenize.resume] == [1, 1]
    gens = Tokenizer(EngineConfig(model=str(demo_model_dir))).prepare(tokenize)
    assert [(g.request_id, g.priority) for g in gens] == [("cmpl-p:0.1", 4), ("cmpl-p:1.1", 4)]
    assert list(gens[0].output_ids) == [5, 6]
