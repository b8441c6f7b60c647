"""--convert reward (pipellm/services/compute/pooling/reward.py, LLMEngine.reward) against
transformers, in process: a Qwen3ForSequenceClassification checkpoint's every token's `score` logits
(no activation), a causal LM's every token's final-normed hidden state (no normalization); the
EmbedCore rows per token; the config and the gateway's answer and refusals."""

from __future__ import annotations

import base64
from array import array

import numpy as np
import pytest
import torch

from pipellm.services.compute.backend import build_engine
from pipellm.services.compute.embed_core import EmbedCore
from pipellm.services.compute.pooling import embedder
from pipellm.services.gateway.embed_encoding import Encoding
from pipellm.services.gateway.embeddings_request import EmbeddingSettings, EmbeddingsRequest
from pipellm.services.gateway.score_api import pooling_answer
from pipellm.shared.config import EngineConfig
from pipellm.shared.messages import EmbedRequest, EmbedResult
from pipellm.shared.sampling import InvalidParams
from pipellm.shared.settings import with_settings
from tests.hf_models import build_hf_model
from tests.scoring_models import build_classifier
from tests.test_pooling import sentences
from tests.test_scoring import token_ids


def engine(path, **settings):
    settings = {"max_batched_tokens": 256, **settings}
    return build_engine(with_settings(EngineConfig(), model=str(path), device="cpu",
                                      dtype="float32", max_model_len=512, kv_cache_tokens=2048,
                                      convert="reward", **settings))


@torch.inference_mode()
def hidden_reference(model, ids: list[list[int]]) -> list[torch.Tensor]:
    """Each prompt's [len, hidden] final-normed hidden states, alone, by transformers."""
    return [model.model(torch.tensor([p])).last_hidden_state[0] for p in ids]


@pytest.fixture(scope="module")
def classifier(tmp_path_factory):
    path = tmp_path_factory.mktemp("rm2")
    return build_classifier(path, 2), engine(path), path


def test_reward_head_logits_match_transformers(classifier):
    model, eng, _ = classifier
    ids = token_ids(sentences(20, seed=7))
    ours = eng.reward(ids)
    with torch.no_grad():
        ref = torch.cat([model.score(h) for h in hidden_reference(model, ids)])
    assert ours.shape == (sum(map(len, ids)), 2) and ours.dtype == torch.float32
    assert torch.allclose(ours, ref, atol=1e-4), (ours - ref).abs().max()
    # per token: the last token's rows are the classifier's logits (HF pools that one)
    last = ours[np.cumsum([len(p) for p in ids]) - 1]
    with torch.no_grad():
        logits = torch.cat([model(torch.tensor([p])).logits for p in ids])
    assert torch.allclose(last, logits, atol=1e-4)
    assert ours.std(0).min() > 1e-3 and (ours < 0).any()  # raw logits: no activation
    assert eng.kv.allocator.free_slots == eng.kv.allocator.capacity


def test_reward_without_a_head_is_the_hidden_states(tmp_path, monkeypatch):
    model = build_hf_model(tmp_path, "qwen3", with_tokenizer=True, initializer_range=0.2,
                           seed=5)
    monkeypatch.setattr(embedder, "MIN_BATCH_TOKENS", 64)
    eng = engine(tmp_path, max_batched_tokens=64, max_running=8)  # batches, rows joined
    ids = token_ids(sentences(12, seed=8))
    ours = eng.reward(ids)
    ref = torch.cat(hidden_reference(model, ids))
    assert ours.shape == ref.shape == (sum(map(len, ids)), 64)
    assert torch.allclose(ours, ref, atol=1e-4), (ours - ref).abs().max()
    assert not torch.allclose(ours.norm(dim=1), torch.ones(len(ours)))  # not normalized
    with pytest.raises(InvalidParams, match="empty"):
        eng.reward([[1, 2], []])


def test_embed_core_gives_each_request_its_tokens_rows(classifier):
    _, eng, _ = classifier
    core = EmbedCore(eng)
    ids = token_ids(["the river", "seven blue mountain quickly", "a"])
    core.submit(EmbedRequest("a", "gw", inputs=[array("i", ids[0]), array("i", ids[1])],
                             task="reward"))
    core.submit(EmbedRequest("b", "gw", inputs=[array("i", ids[2])], task="reward"))
    core.submit(EmbedRequest("c", "gw", inputs=[array("i", [10**6])], task="reward"))
    (_, a), (_, b), (_, c) = core.run()
    ref = eng.reward(ids)
    assert a.dim == b.dim == 2 and list(a.num_tokens) == [len(ids[0]), len(ids[1])]
    assert np.allclose(np.array(a.vectors), ref[:len(ids[0]) + len(ids[1])].flatten())
    assert np.allclose(np.array(b.vectors), ref[-len(ids[2]):].flatten())
    assert c.error_status == 400 and c.error_param == "input" and a.error is None


def test_config():
    cfg = with_settings(EngineConfig(), convert="reward")
    assert cfg.pooling and cfg.reward
    assert not with_settings(EngineConfig(), convert="embed").reward
    with pytest.raises(ValueError, match="--pooler-config"):
        with_settings(EngineConfig(), convert="reward", pooler_config='{"normalize": true}')


def test_pooling_answer_per_token():
    rows = array("f", [float(i) for i in range(10)])  # 2 inputs: 3 and 2 tokens, k = 2
    result = EmbedResult("r", rows, 2, array("i", [3, 2]))
    req = EmbeddingsRequest("m", ("x", "y"), None)
    answer = pooling_answer(result, req, per_token=True)
    assert [d["data"] for d in answer["data"]] == [[[0, 1], [2, 3], [4, 5]], [[6, 7], [8, 9]]]
    assert answer["usage"]["prompt_tokens"] == 5 and answer["object"] == "list"
    b64 = pooling_answer(result, EmbeddingsRequest("m", ("x", "y"), None, Encoding("base64")),
                         per_token=True)
    second = np.frombuffer(base64.b64decode(b64["data"][1]["data"]), dtype="<f4")
    assert second.tolist() == [6, 7, 8, 9]
    assert EmbeddingSettings(True, reward=True).reward
