"""The tokenizer worker attaches the predicted output length and the features to learn from."""

from __future__ import annotations

import redis

from services.tokenizer.service import Tokenizer
from shared.config import EngineConfig
from shared.length_dist import LEVELS, LengthDist
from shared.length_predictor import LengthPredictor, model_key
from shared.messages import TokenizeRequest
from shared.redis_server import EmbeddedRedis
from shared.sampling import SamplingParams


def request(text: str, max_tokens: int, n: int = 1) -> TokenizeRequest:
    return TokenizeRequest("r1", "ipc://gw", SamplingParams(max_tokens=max_tokens),
                           prompt_text=text, n=n)


def test_without_a_predictor_features_still_travel(demo_model_dir):
    tok = Tokenizer(EngineConfig(model=str(demo_model_dir)))
    (gen,) = tok.prepare(request("hello there", 8))
    assert gen.length_quantiles is None and gen.route.length_features


def test_prediction_is_attached_to_every_choice(demo_model_dir):
    cfg = EngineConfig(model=str(demo_model_dir))
    with EmbeddedRedis() as r:
        predictor = LengthPredictor(redis.Redis.from_url(r.url), model_key(cfg.model),
                                    strict=True)
        tok = Tokenizer(cfg, predictor)
        (cold,) = tok.prepare(request("summarize this", 500))
        assert LengthDist(tuple(cold.length_quantiles)) == LengthDist.point(128)  # default
        for gen in tok.prepare(request("summarize this", 500, n=3)):
            predictor.update(gen.route.length_features, 40)  # as the detokenizer does
        gens = tok.prepare(request("summarize this", 30, n=2))
        assert [g.request_id for g in gens] == ["r1:0", "r1:1"]
        for g in gens:
            assert len(g.length_quantiles) == len(LEVELS)
            assert max(g.length_quantiles) <= 30  # capped at max_tokens
        warm = tok.prepare(request("summarize this", 500))[0].length_quantiles
        assert 20 <= LengthDist(tuple(warm)).median <= 80  # learned ~40
