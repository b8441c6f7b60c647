"""Cohere's /v2/embed body and answer (pipellm/services/gateway/cohere_embed.py), no sockets: each
field as Cohere's clients send it, each bad one a 400 on its field; the embedding types made
from the float vectors (numpy's packbits as the reference). End to end with the cohere SDK:
tests/test_embeddings_e2e.py."""

from __future__ import annotations

import base64
from array import array

import numpy as np
import pytest

from pipellm.services.gateway.cohere_embed import cohere_answer, parse_cohere_embed, prompt_prefix
from pipellm.services.gateway.embeddings_request import EmbeddingSettings
from pipellm.services.gateway.errors import APIError
from pipellm.shared.messages import EmbedResult
from pipellm.shared.pooling import PoolingConfig

PROMPTS = (("query", "Q: "), ("document", "D: "))
SETTINGS = EmbeddingSettings(True, PoolingConfig(dimension=16, matryoshka_dims=(8, 16),
                                                 prompts=PROMPTS), 16, 100)


def parse(body: dict, settings: EmbeddingSettings = SETTINGS):
    return parse_cohere_embed({"model": "m", **body}, "m", settings, max_text_bytes=1000)


def test_fields_as_cohere_clients_send_them():
    e = parse({"texts": ["a", "b"], "input_type": "search_query"})
    assert e.request.texts == ("Q: a", "Q: b") and e.texts == ("a", "b")
    assert e.types == ("float",) and e.max_tokens is None
    req = e.request
    assert (req.truncate_prompt_tokens, req.truncation_side, req.dimensions) == (-1, "right", None)
    assert parse({"texts": ["a"], "input_type": "search_document"}).request.texts == ("D: a",)
    assert parse({"texts": ["a"], "input_type": "query"}).request.texts == ("Q: a",)
    plain = EmbeddingSettings(True, PoolingConfig(), 16, 100)  # no prompts: texts as sent
    assert parse({"texts": ["a"], "input_type": "classification"}, plain).request.texts == ("a",)
    start = parse({"texts": ["a"], "truncate": "START", "max_tokens": 7,
                   "output_dimension": 8, "embedding_types": ["ubinary", "float", "ubinary"]})
    assert (start.request.truncate_prompt_tokens, start.request.truncation_side) == (7, "left")
    assert start.request.dimensions == 8 and start.types == ("ubinary", "float")
    none = parse({"texts": ["a"], "truncate": "NONE", "max_tokens": 7})
    assert (none.request.truncate_prompt_tokens, none.max_tokens) == (0, 7)
    assert prompt_prefix((), "anything") == "" and prompt_prefix(PROMPTS, None) == ""
    # inputs: rendered as chat, the prompt as a system message (vLLM's rule)
    chat = parse({"inputs": [{"content": [{"type": "text", "text": "a"}]}],
                  "input_type": "search_query"})
    (conv,) = chat.request.chat.conversations
    assert [(m.role, m.content) for m in conv] == [("system", "Q: "), ("user", "a")]
    assert chat.texts == ("a",) and chat.request.texts is None
    assert not chat.request.add_special_tokens and chat.request.count == 1


@pytest.mark.parametrize("body,param", [
    ({}, "texts"),
    ({"texts": []}, "texts"),
    ({"texts": "a"}, "texts"),
    ({"texts": ["a", 3]}, "texts"),
    ({"texts": ["x" * 1001]}, "texts"),
    ({"texts": ["a"] * 2049}, "texts"),
    ({"images": ["data:image/png;base64,AAAA"]}, "images"),
    ({"inputs": [{"content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "inputs"),
    ({"inputs": [{"content": []}]}, "inputs"),
    ({"inputs": []}, "inputs"),
    ({"texts": ["a"], "input_type": "classification"}, "input_type"),
    ({"texts": ["a"], "output_dimension": 12}, "output_dimension"),
    ({"texts": ["a"], "embedding_types": ["int8"]}, "embedding_types"),
    ({"texts": ["a"], "embedding_types": []}, "embedding_types"),
    ({"texts": ["a"], "truncate": "MIDDLE"}, "truncate"),
    ({"texts": ["a"], "max_tokens": 0}, "max_tokens"),
    ({"texts": ["a"], "max_tokens": 101}, "max_tokens"),
])
def test_bad_bodies_are_400s_on_their_field(body, param):
    with pytest.raises(APIError) as e:
        parse(body)
    assert (e.value.status, e.value.param) == (400, param), e.value.message


def test_binary_types_need_a_width_of_whole_bytes():
    odd = EmbeddingSettings(True, PoolingConfig(), 12, 100)
    with pytest.raises(APIError, match="multiple of 8"):
        parse({"texts": ["a"], "embedding_types": ["binary"]}, odd)
    assert parse({"texts": ["a"], "embedding_types": ["float"]}, odd).types == ("float",)


def test_answer_by_type():
    rng = np.random.default_rng(0)
    rows = rng.standard_normal((3, 16)).astype(np.float32)
    result = EmbedResult("embd-1", array("f", rows.ravel()), 16, array("i", [4, 9, 2]))
    e = parse({"texts": ["a", "b", "c"],
               "embedding_types": ["float", "binary", "ubinary", "base64"]})
    out = cohere_answer(result, e)
    assert out["id"] == "embd-1" and out["texts"] == ["a", "b", "c"]
    assert out["response_type"] == "embeddings_by_type"
    assert out["meta"] == {"api_version": {"version": "2"}, "billed_units": {"input_tokens": 15}}
    emb = out["embeddings"]
    assert np.array_equal(np.array(emb["float"], np.float32), rows)
    ubits = [np.packbits([v >= 0 for v in row]).tolist() for row in rows.tolist()]
    assert emb["ubinary"] == ubits and len(ubits[0]) == 2
    assert emb["binary"] == [[b - 128 for b in row] for row in ubits]
    assert np.array_equal(np.stack([np.frombuffer(base64.b64decode(b), "<f4")
                                    for b in emb["base64"]]), rows)
    none = parse({"texts": ["a", "b", "c"], "truncate": "NONE", "max_tokens": 8})
    with pytest.raises(APIError) as err:
        cohere_answer(result, none)
    assert err.value.param == "max_tokens" and "Input of 9 tokens" in err.value.message
