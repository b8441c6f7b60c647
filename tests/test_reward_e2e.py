"""--convert reward end to end: a real stack on a tiny random Qwen3ForSequenceClassification
(2 labels). /pooling gives each input's [tokens, 2] rows, equal to transformers' `score` layer
over every token's final-normed hidden state (float and base64); what a reward server does not
serve is a 400 naming its field, and the server answers afterwards."""

from __future__ import annotations

import base64

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from tests.scoring_models import build_classifier
from tests.stack import Stack
from tests.test_pooling import sentences


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = tmp_path_factory.mktemp("rm")
    model = build_classifier(path, 2, seed=9)
    stack = Stack(path, "--convert", "reward", "--max-model-len", "512", "--kv-cache-tokens",
                  "4096", "--dtype", "float32", "--served-model-name", "rm").start(timeout_s=300)
    yield stack, model, AutoTokenizer.from_pretrained(str(path))
    stack.stop()


@torch.no_grad()
def per_token(model, ids: list[int]) -> np.ndarray:
    hidden = model.model(torch.tensor([ids])).last_hidden_state[0]
    return model.score(hidden).numpy()


def test_pooling_gives_every_tokens_reward(served):
    stack, model, tok = served
    texts = sentences(6, seed=11)
    status, answer = stack.post("/pooling", {"model": "rm", "input": texts})
    assert status == 200, answer
    assert [d["index"] for d in answer["data"]] == list(range(6))
    total = 0
    for text, item in zip(texts, answer["data"], strict=True):
        ids = tok(text)["input_ids"]
        ours = np.array(item["data"])
        assert item["object"] == "pooling" and ours.shape == (len(ids), 2)
        assert np.allclose(ours, per_token(model, ids), atol=1e-4)
        total += len(ids)
    assert answer["usage"]["prompt_tokens"] == total
    status, b64 = stack.post("/pooling", {"model": "rm", "input": [[5, 6, 7]],
                                          "encoding_format": "base64"})
    assert status == 200, b64
    rows = np.frombuffer(base64.b64decode(b64["data"][0]["data"]), dtype="<f4").reshape(3, 2)
    assert np.allclose(rows, per_token(model, [5, 6, 7]), atol=1e-4)


def test_what_a_reward_server_does_not_serve(served):
    stack, _, _ = served
    for path, body, param in (("/v1/embeddings", {"input": "a"}, "model"),
                              ("/score", {"text_1": "a", "text_2": "b"}, "model"),
                              ("/v1/rerank", {"query": "a", "documents": ["b"]}, "model"),
                              ("/classify", {"input": "a"}, "model"),
                              ("/pooling", {"input": "a", "dimensions": 1}, "dimensions"),
                              ("/pooling", {"input": []}, "input"),
                              ("/v1/completions", {"prompt": "a"}, "model")):
        status, answer = stack.post(path, {"model": "rm", **body})
        assert status == 400, (path, answer)
        assert answer["error"]["param"] == param, (path, answer)
        if param == "model" and path != "/v1/completions":
            assert "reward model" in answer["error"]["message"]
    status, answer = stack.post("/pooling", {"model": "rm", "input": "still serving"})
    assert status == 200 and len(answer["data"][0]["data"]) > 1
