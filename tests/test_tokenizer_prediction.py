"""The tokenizer worker attaches the predicted output length and the features to learn from."""

from __future__ import annotations

import dataclasses
import json

import pytest
import redis

from pipellm.services.tokenizer.service import Tokenizer
from pipellm.shared.config import EngineConfig
from pipellm.shared.length_dist import LEVELS, LengthDist
from pipellm.shared.length_predictor import LengthPredictor, model_key
from pipellm.shared.messages import TokenizeRequest
from pipellm.shared.redis_server import EmbeddedRedis
from pipellm.shared.sampling import SamplingParams


def request(text: str, max_tokens: int, n: int = 1) -> TokenizeRequest:
    return TokenizeRequest("r1", "ipc://gw", SamplingParams(max_tokens=max_tokens),
                           prompt_text=text, n=n)


def test_without_a_predictor_features_still_travel(demo_model_dir):
    tok = Tokenizer(EngineConfig(model=str(demo_model_dir)))
    (gen,) = tok.prepare(request("hello there", 8))
    assert gen.predicted_length is None and gen.route.length_features


def test_prediction_is_attached_to_every_choice(demo_model_dir):
    cfg = EngineConfig(model=str(demo_model_dir))
    with EmbeddedRedis() as r:
        predictor = LengthPredictor(redis.Redis.from_url(r.url), model_key(cfg.model),
                                    strict=True)
        tok = Tokenizer(cfg, predictor)
        (cold,) = tok.prepare(request("summarize this", 500))
        assert LengthDist(tuple(cold.predicted_length)) == LengthDist.point(128)  # default
        for gen in tok.prepare(request("summarize this", 500, n=3)):
            predictor.update(gen.route.length_features, 40)  # as the detokenizer does
        gens = tok.prepare(request("summarize this", 30, n=2))
        assert [g.request_id for g in gens] == ["r1:0", "r1:1"]
        for g in gens:
            assert len(g.predicted_length) == len(LEVELS)
            assert max(g.predicted_length) <= 30  # capped at max_tokens
        warm = tok.prepare(request("summarize this", 500))[0].predicted_length
        assert 20 <= LengthDist(tuple(warm)).median <= 80  # learned ~40


def test_a_length_only_max_tokens_can_end_is_that_point_and_is_not_learned(demo_model_dir):
    """ignore_eos with no stop string or stop token: exactly max_tokens (what benchmarks send);
    the request carries no features, so the detokenizer teaches the predictor nothing from it.
    A stop string can still end it early: predicted and learned as usual."""
    cfg = EngineConfig(model=str(demo_model_dir))
    with EmbeddedRedis() as r:
        predictor = LengthPredictor(redis.Redis.from_url(r.url), model_key(cfg.model),
                                    strict=True)
        tok = Tokenizer(cfg, predictor)
        fixed = TokenizeRequest("r1", "ipc://gw", SamplingParams(max_tokens=700, ignore_eos=True),
                                prompt_text="summarize this")
        (gen,) = tok.prepare(fixed)
        assert LengthDist(tuple(gen.predicted_length)) == LengthDist.point(700)
        assert not gen.route.length_features
        stopped = TokenizeRequest("r2", "ipc://gw", SamplingParams(max_tokens=700,
                                                                   ignore_eos=True),
                                  prompt_text="summarize this", stop=["."])
        (gen,) = tok.prepare(stopped)
        assert LengthDist(tuple(gen.predicted_length)) == LengthDist.point(128)  # the default
        assert gen.route.length_features


def test_min_tokens_beyond_the_room_is_a_prompt_error_not_a_crash(demo_model_dir):
    """Found by the hostile-input tests: chat without max_tokens fills the context, and a
    min_tokens larger than the room left used to raise InvalidParams and kill the worker."""
    import pytest

    from pipellm.services.tokenizer.service import PromptError

    tok = Tokenizer(EngineConfig(model=str(demo_model_dir), max_model_len=64))
    req = TokenizeRequest("r1", "ipc://gw", SamplingParams(max_tokens=16, min_tokens=10),
                          prompt_text="word " * 28, max_tokens_auto=True)  # 59 tokens
    with pytest.raises(PromptError, match="maximum context length is 64"):
        tok.prepare(req)


def test_resumed_choices_continue_with_their_outputs(demo_model_dir):
    from array import array

    from pipellm.shared.messages import Resume

    tok = Tokenizer(EngineConfig(model=str(demo_model_dir)))
    req = TokenizeRequest("r1", "ipc://gw", SamplingParams(max_tokens=8, seed=5,
                                                           prompt_logprobs=2),
                          prompt_text="hello there", n=3)
    first = tok.prepare(req)
    req.resume = [Resume(2, 1, array("i", [7, 8]), 3)]
    (gen,) = tok.prepare(req)
    assert gen.request_id == "r1:2.1" and list(gen.output_ids) == [7, 8]
    assert gen.prompt_ids == first[2].prompt_ids and gen.params.seed == first[2].params.seed == 7
    assert gen.params.prompt_logprobs is None  # delivered with the choice's first delta
    assert gen.route.resume.sent_chars == 3 and first[2].route.resume is None


def test_request_templates_documents_and_special_tokens_as_transformers(demo_model_dir):
    """A chat request's own template (the gateway let it through), its `documents` as the
    template variable, and add_special_tokens, as transformers' apply_chat_template and
    tokenizer give them; a template that does not compile is a PromptError."""
    from transformers import AutoTokenizer

    from pipellm.services.tokenizer.service import PromptError
    from pipellm.shared.messages import ChatMessage

    tok = Tokenizer(EngineConfig(model=str(demo_model_dir)))
    hf = AutoTokenizer.from_pretrained(demo_model_dir)
    rag = ("{{ bos_token }}{% for d in documents %}[{{ d.title }}: {{ d.text }}]{% endfor %}"
           "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>")
    docs = [{"title": "river", "text": "water flows"}, {"title": "sea", "text": "salt"}]
    msg = TokenizeRequest("r", "gw", SamplingParams(max_tokens=4),
                          messages=[ChatMessage("user", "where does it go")],
                          chat_template=rag, chat_template_kwargs=json.dumps({"documents": docs}))
    text, ids = tok.prompt(msg)
    want = hf.apply_chat_template([{"role": "user", "content": "where does it go"}],
                                  chat_template=rag, documents=docs, tokenize=False)
    assert text == want and text.startswith("<s>[river: water flows][sea: salt]<user>")
    assert ids == hf(want, add_special_tokens=False)["input_ids"]
    model_own, _ = tok.prompt(dataclasses.replace(msg, chat_template=""))
    assert model_own != text
    plain = request("hello there", 4)
    assert tok.prompt(plain)[1] == hf("hello there")["input_ids"]  # BOS added
    bare = dataclasses.replace(plain, add_special_tokens=False)
    assert tok.prompt(bare)[1] == hf("hello there", add_special_tokens=False)["input_ids"]
    assert tok.prompt(bare)[1] != tok.prompt(plain)[1]
    with pytest.raises(PromptError, match="chat template failed"):
        tok.prepare(dataclasses.replace(msg, chat_template="{% for %}"))
