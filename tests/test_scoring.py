"""Scoring heads in compute (pipellm/services/compute/pooling/scoring.py, LLMEngine.classify)
against transformers, in process: a Qwen3ForSequenceClassification's logits (3 labels), and a Qwen3
causal LM as a yes/no reranker (vLLM's --hf-overrides): logit[yes] - logit[no] at the last
token; ScoringConfig from config.json and the overrides."""

from __future__ import annotations

import json

import pytest
import torch

from pipellm.services.compute.backend import build_engine
from pipellm.services.compute.pooling.embedder import MIN_SHARED, shared_prefix
from pipellm.shared.config import EngineConfig
from pipellm.shared.model_config import ModelConfig
from pipellm.shared.sampling import InvalidParams
from pipellm.shared.scoring import CLASSIFY, NONE, YES_NO, ScoringConfig, names_classifier
from pipellm.shared.settings import with_settings
from tests.hf_models import build_hf_model, demo_tokenizer
from tests.scoring_models import (
    YES_NO_OVERRIDES,
    YES_NO_TOKENS,
    build_classifier,
    build_yes_no,
    classifier_logits,
    yes_no_reference,
)
from tests.test_pooling import sentences


def engine(path, **settings):
    return build_engine(with_settings(EngineConfig(), model=str(path), device="cpu",
                                      dtype="float32", max_model_len=512, kv_cache_tokens=2048,
                                      max_batched_tokens=256, runner="pooling", **settings))


def token_ids(texts: list[str]) -> list[list[int]]:
    return [e.ids for e in demo_tokenizer().encode_batch(texts)]


@pytest.fixture(scope="module")
def classifier(tmp_path_factory):
    path = tmp_path_factory.mktemp("cls3")
    return build_classifier(path, 3), engine(path)


def test_classifier_logits_match_transformers(classifier):
    model, eng = classifier
    assert eng.scoring.scoring == ScoringConfig(CLASSIFY, ("LABEL_0", "LABEL_1", "LABEL_2"))
    ids = token_ids(sentences(30, seed=5))
    ours = eng.classify(ids)
    ref = classifier_logits(model, ids)
    assert ours.shape == (30, 3) and ours.dtype == torch.float32
    assert torch.allclose(ours, ref, atol=1e-4), (ours - ref).abs().max()
    assert ours.std(0).min() > 1e-3  # the prompts' scores differ
    assert eng.kv.allocator.free_slots == eng.kv.allocator.capacity
    assert tuple(eng.embed(ids[:2]).shape) == (2, 64)  # it still embeds


def test_yes_no_reranker_matches_transformers(tmp_path):
    model = build_yes_no(tmp_path)
    eng = engine(tmp_path, hf_overrides=YES_NO_OVERRIDES)
    assert eng.scoring.scoring == ScoringConfig(YES_NO, ("score",), tuple(YES_NO_TOKENS), True)
    ids = token_ids(sentences(12, seed=6))
    ours = torch.sigmoid(eng.classify(ids)[:, 0])
    ref = torch.tensor(yes_no_reference(model, ids))
    assert torch.allclose(ours, ref, atol=1e-5), (ours - ref).abs().max()
    assert ours.std() > 1e-3


def test_a_reranker_scores_documents_behind_one_query(tmp_path):
    """A rerank's prompts (an instruction and the query, then each document): the shared
    prefix runs once, every score still transformers' on the whole prompt."""
    model = build_yes_no(tmp_path)
    eng = engine(tmp_path, hf_overrides=YES_NO_OVERRIDES)
    texts = sentences(11, seed=7)  # the third: 150 words
    query = token_ids(texts[2:3])[0][:40]
    ids = [query + doc for doc in token_ids(texts[3:])]
    assert len(query) >= MIN_SHARED and shared_prefix(ids) >= len(query)
    ours = torch.sigmoid(eng.classify(ids)[:, 0])
    ref = torch.tensor(yes_no_reference(model, ids))
    assert torch.allclose(ours, ref, atol=1e-5), (ours - ref).abs().max()
    assert ours.std() > 1e-3
    assert eng.kv.allocator.free_slots == eng.kv.allocator.capacity


def test_embedder_has_no_head(tmp_path):
    build_hf_model(tmp_path, "qwen3", with_tokenizer=True)
    eng = engine(tmp_path)
    with pytest.raises(InvalidParams, match="no scoring head") as e:
        eng.classify([[1, 2, 3]])
    assert e.value.param == "model"


def test_scoring_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"architectures": ["LlamaForSequenceClassification"],
         "id2label": {"1": "pos", "0": "neg"}}))
    assert ScoringConfig.from_dir(tmp_path).labels == ("neg", "pos")
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"]}))
    assert ScoringConfig.from_dir(tmp_path).kind == NONE
    assert ScoringConfig.from_dir(tmp_path, convert="classify").labels == ("LABEL_0", "LABEL_1")
    over = ScoringConfig.from_dir(tmp_path, YES_NO_OVERRIDES)
    assert over.kind == YES_NO and over.qwen3_template and over.num_labels == 1
    assert names_classifier(YES_NO_OVERRIDES) and not names_classifier("")
    for bad, match in (('{"classifier_from_token": ["no"], "architectures": '
                        '["Qwen3ForSequenceClassification"]}', "two tokens"),
                       ('{"rope_theta": 1}', "not supported"), ("[]", "JSON object")):
        with pytest.raises(ValueError, match=match):
            ScoringConfig.from_dir(tmp_path, bad)


def test_model_config_reads_a_classifier_as_its_decoder(tmp_path):
    build_classifier(tmp_path, 1)
    assert ModelConfig.from_dir(tmp_path).architecture == "Qwen3ForCausalLM"
    assert ModelConfig.from_dir(tmp_path).qk_norm


def test_start_up_refusals(tmp_path):
    """A classifier on the generation runner, or a head the checkpoint lacks: clear errors
    before serving."""
    from pipellm.services.cli import _check_model

    build_classifier(tmp_path / "cls", 1)
    with pytest.raises(ValueError, match="sequence classification model"):
        _check_model(EngineConfig(model=str(tmp_path / "cls")))
    _check_model(EngineConfig(model=str(tmp_path / "cls"), runner="pooling"))
    build_hf_model(tmp_path / "lm", "qwen3", with_tokenizer=True)
    with pytest.raises(ValueError, match="no score.weight"):
        _ = engine(tmp_path / "lm", convert="classify").scoring
    bad = '{"architectures": ["Qwen3ForSequenceClassification"], ' \
          '"classifier_from_token": ["no", "yes"]}'
    with pytest.raises(ValueError, match="not a token of the vocabulary"):
        engine(tmp_path / "lm", hf_overrides=bad)
