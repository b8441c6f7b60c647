"""The scoring APIs' pieces: parsing /score, /rerank and /classify bodies (each bad one a 400
on its field), the answers' shapes (vLLM's and Jina's), the tokenizer's text pairs, compute's
EmbedCore running a classify task, the messages on the wire (no sockets); then the gateway in
process over real zmq and Redis with a fake tokenizer: the request it sends on and the answer
it makes (an embedder's: the cosine of embeddings), and the 400s where a server does not
serve an API (a generation server; /classify on an embedder)."""

from __future__ import annotations

import asyncio
import base64
import math
from array import array

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from pipellm.services.compute.embed_core import EmbedCore
from pipellm.services.gateway.embed_encoding import Encoding
from pipellm.services.gateway.embeddings_request import (
    EmbeddingSettings,
    EmbeddingsRequest,
    pooling_task,
)
from pipellm.services.gateway.errors import APIError
from pipellm.services.gateway.score_api import (
    classify_answer,
    pooling_answer,
    rerank_answer,
    score_answer,
    sigmoid,
    softmax,
)
from pipellm.services.gateway.score_pairs import pair_scores, pairs_message, truncate_pairs
from pipellm.services.gateway.score_request import (
    MAX_PAIRS,
    PairsRequest,
    parse_classify,
    parse_rerank,
    parse_score,
)
from pipellm.services.tokenizer.embed import prepare_embed
from pipellm.shared import codec
from pipellm.shared.messages import EmbedRequest, EmbedResult
from pipellm.shared.scoring import CLASSIFY, YES_NO, ScoringConfig, reranker_prompt
from tests.test_embeddings_gateway import reply, run_gateway

LIMITS = {"max_text_bytes": 1000}


def score(body):
    return parse_score(body, "m", 100, **LIMITS)


def rerank(body):
    return parse_rerank(body, "m", 100, **LIMITS)


def test_score_pairs_as_vllm_forms_them():
    assert score({"text_1": "q", "text_2": "d"}).pairs == (("q", "d"),)
    assert score({"text_1": "q", "text_2": ["a", "b"]}).pairs == (("q", "a"), ("q", "b"))
    assert score({"text_1": ["q"], "text_2": ["a", "b"]}).pairs == (("q", "a"), ("q", "b"))
    assert score({"text_1": ["x", "y"], "text_2": ["a", "b"]}).pairs == (("x", "a"), ("y", "b"))
    assert score({"text_1": "q", "text_2": "d", "truncate_prompt_tokens": 7}
                 ).truncate_prompt_tokens == 7
    assert score({"text_1": ["q"], "text_2": ["a", "b"]}).shared_first
    assert not score({"text_1": ["x", "y"], "text_2": ["a", "b"]}).shared_first
    # vLLM's other names for the two sides
    for first, second in (("queries", "documents"), ("queries", "items"), ("data_1", "data_2")):
        req = score({first: "q", second: ["a", "b"]})
        assert req.pairs == (("q", "a"), ("q", "b")) and req.shared_first
    req = score({"text_1": "q", "text_2": "d", "max_tokens_per_query": 3,
                 "max_tokens_per_doc": 5, "truncation_side": "left", "use_activation": False})
    assert (req.max_tokens, req.truncation_side, req.use_activation) == ((3, 5), "left", False)
    assert score({"text_1": "q", "text_2": "d", "instruction": "find it"}).instruction == "find it"
    assert score({"text_1": "q", "text_2": "d", "instruction": "a", "chat_template_kwargs": {
        "instruction": "b"}}).instruction == "b"  # vLLM's merge: the kwargs' own wins
    plain = score({"text_1": "q", "text_2": "d"})
    assert (plain.max_tokens, plain.truncation_side, plain.use_activation) == (
        (0, 0), "right", True)


def test_rerank_body():
    req = rerank({"query": "q", "documents": ["a", {"text": "b"}], "top_n": 1})
    assert req == PairsRequest("m", (("q", "a"), ("q", "b")), 0, 1, True, shared_first=True)
    assert not rerank({"query": "q", "documents": ["a"], "return_documents": False}
                      ).return_documents
    assert rerank({"query": "q", "documents": "a"}).pairs == (("q", "a"),)
    c = parse_classify({"input": ["a", "b"]}, "m", 100, **LIMITS)
    assert c.texts == ("a", "b") and c.ids is None
    assert parse_classify({"input": [1, 2]}, "m", 100, **LIMITS).ids == ((1, 2),)


BAD = [
    (score, {"text_2": "a"}, "text_1"),
    (score, {"text_1": "a"}, "text_2"),
    (score, {"text_1": 3, "text_2": "a"}, "text_1"),
    (score, {"text_1": ["a", 3], "text_2": "a"}, "text_1"),
    (score, {"text_1": "a", "text_2": []}, "text_2"),
    (score, {"text_1": ["a", "b"], "text_2": ["a"]}, "text_2"),
    (score, {"text_1": "a", "text_2": ["b"] * (MAX_PAIRS + 1)}, "text_2"),
    (score, {"text_1": "a" * 1001, "text_2": "b"}, "text_1"),
    (score, {"text_1": "a", "text_2": "b", "truncate_prompt_tokens": 101},
     "truncate_prompt_tokens"),
    (score, {"queries": "a"}, "documents"),
    (score, {"items": ["a"]}, "queries"),
    (score, {"queries": ["a", "b"], "documents": ["c"] * 3}, "documents"),
    (score, {"text_1": "a", "text_2": "b", "max_tokens_per_doc": -1}, "max_tokens_per_doc"),
    (score, {"text_1": "a", "text_2": "b", "max_tokens_per_query": 101},
     "max_tokens_per_query"),
    (score, {"text_1": "a", "text_2": "b", "use_activation": 1}, "use_activation"),
    (score, {"text_1": "a", "text_2": "b", "instruction": 3}, "instruction"),
    (score, {"text_1": "a", "text_2": "b", "chat_template_kwargs": "x"}, "chat_template_kwargs"),
    (rerank, {"documents": ["a"]}, "query"),
    (rerank, {"query": "", "documents": ["a"]}, "query"),
    (rerank, {"query": ["q"], "documents": ["a"]}, "query"),
    (rerank, {"query": "q"}, "documents"),
    (rerank, {"query": "q", "documents": []}, "documents"),
    (rerank, {"query": "q", "documents": {"text": "a"}}, "documents"),
    (rerank, {"query": "q", "documents": [None]}, "documents"),
    (rerank, {"query": "q", "documents": [{"text": "a", "title": "t"}]}, "documents"),
    (rerank, {"query": "q", "documents": ["a"] * (MAX_PAIRS + 1)}, "documents"),
    (rerank, {"query": "q", "documents": ["a"], "top_n": -1}, "top_n"),
    (rerank, {"query": "q", "documents": ["a"], "top_n": 1.5}, "top_n"),
    (rerank, {"query": "q", "documents": ["a"], "return_documents": 1}, "return_documents"),
    (lambda b: parse_classify(b, "m", 100, **LIMITS), {"input": []}, "input"),
]


@pytest.mark.parametrize("i", range(len(BAD)))
def test_bad_bodies_are_400s_on_their_field(i):
    parse, body, param = BAD[i]
    with pytest.raises(APIError) as e:
        parse(body)
    assert e.value.status == 400 and e.value.param == param, e.value.message


def test_unknown_keys_and_models():
    with pytest.raises(APIError) as e:
        parse_score({"text_1": "a", "text_2": "b", "color": 1}, "m", 100, **LIMITS)
    assert e.value.status == 400
    ignored = []
    parse_rerank({"query": "a", "documents": ["b"], "color": 1}, "m", 100, ignored=ignored,
                 **LIMITS)
    assert ignored == ["color"]
    with pytest.raises(APIError) as e:
        score({"model": "other", "text_1": "a", "text_2": "b"})
    assert e.value.status == 404


def test_answers():
    out = score_answer("m", [0.25, 0.75], 9)
    assert out["object"] == "list" and out["model"] == "m" and out["id"].startswith("score-")
    assert out["data"] == [{"index": 0, "object": "score", "score": 0.25},
                           {"index": 1, "object": "score", "score": 0.75}]
    assert out["usage"] == {"prompt_tokens": 9, "total_tokens": 9, "completion_tokens": 0}
    req = PairsRequest("m", (("q", "a"), ("q", "b"), ("q", "c")))
    ranked = rerank_answer(req, [0.1, 0.9, 0.5], 12)
    assert set(ranked) == {"id", "model", "usage", "results"}
    assert ranked["usage"] == {"prompt_tokens": 12, "total_tokens": 12}
    assert ranked["results"] == [{"index": 1, "relevance_score": 0.9, "document": {"text": "b"}},
                                 {"index": 2, "relevance_score": 0.5, "document": {"text": "c"}},
                                 {"index": 0, "relevance_score": 0.1, "document": {"text": "a"}}]
    top = rerank_answer(PairsRequest("m", req.pairs, 0, 2, False), [0.1, 0.9, 0.5], 12)
    assert top["results"] == [{"index": 1, "relevance_score": 0.9},
                              {"index": 2, "relevance_score": 0.5}]
    assert len(rerank_answer(PairsRequest("m", req.pairs, 0, 9), [0, 1, 2], 1)["results"]) == 3


def test_classify_and_pooling_answers():
    result = EmbedResult("r", array("f", [0.0, 1.0, 2.0, 2.0, 1.0, 0.0]), 3, array("i", [4, 5]))
    out = classify_answer(parse_classify({"input": ["a", "b"]}, "m", 100, **LIMITS), result,
                          ("x", "y", "z"))
    assert [d["label"] for d in out["data"]] == ["z", "x"]
    assert np.allclose(out["data"][0]["probs"], torch.softmax(torch.tensor([0., 1, 2]), 0))
    assert out["data"][0]["num_classes"] == 3 and out["usage"]["total_tokens"] == 9
    one = classify_answer(parse_classify({"input": "a"}, "m", 100, **LIMITS),
                          EmbedResult("r", array("f", [-1.0]), 1, array("i", [2])), ("s",))
    assert one["data"][0]["probs"] == [pytest.approx(1 / (1 + math.e))]
    raw = classify_answer(parse_classify({"input": "a", "use_activation": False}, "m", 100,
                                         **LIMITS),
                          EmbedResult("r", array("f", [-1.0]), 1, array("i", [2])), ("s",))
    assert raw["data"][0]["probs"] == [-1.0]
    rows = EmbedResult("pool-r", array("f", [1.0, 2.0]), 2, array("i", [3]))
    pooled = pooling_answer(rows, EmbeddingsRequest("m", ("a",), None))
    assert pooled["data"] == [{"index": 0, "object": "pooling", "data": [1.0, 2.0]}]
    assert pooled["id"] == "pool-r" and pooled["object"] == "list"  # the request's id
    b64 = pooling_answer(rows, EmbeddingsRequest("m", ("a",), None, Encoding("base64")))
    assert np.frombuffer(base64.b64decode(b64["data"][0]["data"]), "<f4").tolist() == [1, 2]
    assert sigmoid(-800) == 0 and sigmoid(800) == 1 and sigmoid(0) == 0.5
    assert softmax([1000, 1000]) == [0.5, 0.5]


def test_tokenizer_pairs(demo_model_dir):
    tok = Tokenizer.from_file(str(demo_model_dir / "tokenizer.json"))
    req = prepare_embed(tok, EmbedRequest("r", "a", texts=["what is it", "x"],
                                          texts_2=["a river", "y z"], task="classify"),
                        100, 1000)
    assert [list(i) for i in req.inputs] == [tok.encode("what is it", "a river").ids,
                                             tok.encode("x", "y z").ids]
    assert req.texts is None and req.texts_2 is None and req.task == "classify"
    assert codec.decode(codec.encode(req)) == req
    msg = EmbedRequest("r", "a", texts=["q"], texts_2=["d"], task="classify")
    assert codec.decode(codec.encode(msg)) == msg


def test_pooling_serves_the_models_own_task():
    """/pooling's task is the model's (vLLM's names); another, or a removed one, is a 400."""
    embedder = EmbeddingSettings(True)
    classifier = EmbeddingSettings(True, scoring=ScoringConfig(CLASSIFY, ("a", "b")))
    reward = EmbeddingSettings(True, reward=True)
    assert [s.task for s in (embedder, classifier, reward)] == [
        "embed", "classify", "token_classify"]
    body = {"input": "x", "task": "classify"}
    assert pooling_task(body, classifier) == "classify" and body == {"input": "x"}
    assert pooling_task({"input": "x"}, reward) == "token_classify"
    for task, match in (("classify", r"Supported tasks: \('embed',\)"), ("score", "removed"),
                        (3, "Unsupported")):
        with pytest.raises(APIError, match=match) as e:
            pooling_task({"task": task}, embedder)
        assert e.value.param == "task"


def test_pairs_cut_to_their_token_limits(demo_model_dir):
    """max_tokens_per_query / max_tokens_per_doc: each text cut to what tokenizes to its first
    k tokens (vLLM's rule), before the pairs become one message; the scores of a head are the
    sigmoid of its logits, or the logits with use_activation false."""
    tok = Tokenizer.from_file(str(demo_model_dir / "tokenizer.json"))
    query, doc = "where does the river meet the sea", "the river meets the sea at the delta"
    req = score({"text_1": query, "text_2": [doc, "a"], "max_tokens_per_query": 3,
                 "max_tokens_per_doc": 4})
    cut = truncate_pairs(req, tok)
    ids = lambda text: tok.encode(text, add_special_tokens=False).ids  # noqa: E731
    assert ids(cut.pairs[0][0]) == ids(query)[:3] and ids(cut.pairs[0][1]) == ids(doc)[:4]
    assert cut.pairs[1] == (cut.pairs[0][0], "a")  # under the limit: as it was
    assert query.startswith(cut.pairs[0][0]) and doc.startswith(cut.pairs[0][1])
    assert truncate_pairs(score({"text_1": query, "text_2": doc}), tok).pairs == ((query, doc),)
    head = ScoringConfig(CLASSIFY, ("score",))
    result = EmbedResult("r", array("f", [0.0, -2.0]), 1, array("i", [3, 3]))
    assert pair_scores(req, head, result) == [0.5, sigmoid(-2.0)]
    raw = score({"text_1": query, "text_2": [doc, "a"], "use_activation": False})
    assert pair_scores(raw, head, result) == [0.0, -2.0]
    msg = pairs_message(cut, head, "r", "gw")
    assert (msg.texts, msg.texts_2, msg.truncation_side) == (
        [cut.pairs[0][0]] * 2, [cut.pairs[0][1], "a"], "right")


class FakeEngine:
    def __init__(self):
        self.calls = []

    def embed(self, prompts, dimensions=None, normalize=None):
        self.calls.append(("embed", len(prompts)))
        return torch.ones(len(prompts), 4)

    def classify(self, prompts):
        self.calls.append(("classify", len(prompts)))
        return torch.tensor([[float(len(p))] for p in prompts])


def test_embed_core_runs_classify_apart():
    engine = FakeEngine()
    core = EmbedCore(engine, budget=1000)
    ids = lambda *p: [array("i", x) for x in p]  # noqa: E731
    core.submit(EmbedRequest("a", "gw", ids([1, 2], [3]), task="classify"))
    core.submit(EmbedRequest("b", "gw", ids([5, 6, 7])))
    core.submit(EmbedRequest("c", "gw", ids([5, 6, 7]), task="classify"))
    out = dict((r.request_id, r) for _, r in core.run())
    assert sorted(engine.calls) == [("classify", 3), ("embed", 1)]
    assert list(out["a"].vectors) == [2.0, 1.0] and out["a"].dim == 1
    assert list(out["c"].vectors) == [3.0] and out["b"].dim == 4


def _gateway_posts(demo_model_dir, url, runner, *posts):
    async def body(gw, client, tokenizer):
        out = []
        for path, payload in posts:
            r = await client.post(path, json=payload)
            out.append((r.status, await r.json()))
        return out

    return run_gateway(demo_model_dir, url, body, runner=runner)


def test_servers_that_do_not_score_refuse(demo_model_dir, redis_url):  # noqa: F811
    posts = [("/score", {"text_1": "a", "text_2": "b"}),
             ("/rerank", {"query": "a", "documents": ["b"]}),
             ("/classify", {"input": "a"}), ("/pooling", {"input": "a"})]
    for status, answer in _gateway_posts(demo_model_dir, redis_url, "generate", *posts):
        assert status == 400 and answer["error"]["param"] == "model"
        assert "--runner pooling" in answer["error"]["message"]
    # an embedder scores by cosine (test_embedder_scores_by_cosine); it cannot classify
    for status, answer in _gateway_posts(demo_model_dir, redis_url, "pooling", posts[2]):
        assert status == 400 and answer["error"]["param"] == "model"
        assert "embedding model without a scoring head" in answer["error"]["message"]


def test_embedder_scores_by_cosine(demo_model_dir, redis_url):  # noqa: F811
    """On an embedding model /rerank and /score embed each text once (the shared query once)
    and score a pair by the cosine of its embeddings, as vLLM's bi-encoder."""
    vectors = {"q": [1.0, 0.0], "a": [0.6, 0.8], "b": [-2.0, 0.1], "x": [0.0, 3.0]}

    async def body(gw, client, tokenizer):
        out = []
        for path, payload in (("/v2/rerank", {"query": "q", "documents": ["a", "b", "x"]}),
                              ("/v1/score", {"text_1": ["q", "x"], "text_2": ["a", "a"]})):
            post = asyncio.create_task(client.post(path, json=payload))
            msg = codec.decode(await tokenizer.recv())
            rows = array("f", [v for t in msg.texts for v in vectors[t]])
            reply(msg.reply_to, EmbedResult(msg.request_id, rows, 2,
                                            array("i", [2] * len(msg.texts))))
            r = await post
            out.append((msg, r.status, await r.json()))
        return out

    (rr, status, answer), (sc, status2, scored) = run_gateway(demo_model_dir, redis_url, body)
    assert rr.task == "embed" and rr.texts == ["q", "a", "b", "x"] and rr.texts_2 is None
    assert rr.add_special_tokens and rr.dimensions == 0
    assert status == 200 and [r["index"] for r in answer["results"]] == [0, 2, 1]
    cos_b = -2.0 / math.hypot(-2.0, 0.1)
    assert [r["relevance_score"] for r in answer["results"]] == pytest.approx(
        [0.6, 0.0, cos_b])
    assert answer["results"][1]["document"] == {"text": "x"}
    assert answer["usage"] == {"prompt_tokens": 8, "total_tokens": 8}
    assert sc.texts == ["q", "x", "a", "a"]  # N and N: every text_1 embedded
    assert status2 == 200 and [d["score"] for d in scored["data"]] == pytest.approx([0.6, 0.8])
    assert scored["usage"]["prompt_tokens"] == 8


def test_rerank_through_the_gateway(demo_model_dir, redis_url):  # noqa: F811
    async def body(gw, client, tokenizer):
        out = []
        for scoring in (ScoringConfig(CLASSIFY, ("s",)),
                        ScoringConfig(YES_NO, ("score",), ("no", "yes"), True)):
            gw.embeddings_api.settings = EmbeddingSettings(True, max_model_len=100,
                                                           scoring=scoring)
            post = asyncio.create_task(client.post("/v1/rerank", json={
                "query": "q", "documents": ["a", "b"]}))
            msg = codec.decode(await tokenizer.recv())
            reply(msg.reply_to, EmbedResult(msg.request_id, array("f", [-1.0, 2.0]), 1,
                                            array("i", [3, 4])))
            r = await post
            out.append((msg, r.status, await r.json()))
        post = asyncio.create_task(client.post("/score", json={"text_1": "q", "text_2": "a"}))
        msg = codec.decode(await tokenizer.recv())
        reply(msg.reply_to, EmbedResult(msg.request_id, error="input 0 is too long",
                                        error_status=400, error_param="input"))
        r = await post
        out.append((msg, r.status, await r.json()))
        return out

    (pair, status, answer), (prompt, _, _), (_, bad, err) = run_gateway(
        demo_model_dir, redis_url, body)
    assert pair.task == "classify" and pair.texts == ["q", "q"] and pair.texts_2 == ["a", "b"]
    assert status == 200 and [r["index"] for r in answer["results"]] == [1, 0]
    assert answer["results"][0]["relevance_score"] == pytest.approx(sigmoid(2.0))
    assert answer["usage"] == {"prompt_tokens": 7, "total_tokens": 7}
    assert prompt.texts == [reranker_prompt("q", "a"), reranker_prompt("q", "b")]
    assert prompt.texts_2 is None and not prompt.add_special_tokens
    assert bad == 400 and err["error"]["param"] == "text_2"
