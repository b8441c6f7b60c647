"""Sampling defaults from the model (--generation-config, --override-generation-config): how
they are resolved, how requests get them, and a real server serving them."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import pytest
from gguf import GGUFWriter

from pipellm.services.gateway.protocol import parse_chat, parse_completion
from pipellm.shared.config import EngineConfig
from pipellm.shared.generation_config import GenerationDefaults
from pipellm.shared.sampling import SamplingParams

MSG = [{"role": "user", "content": "hi"}]
PARSE = {"completion": (parse_completion, {"prompt": "hi"}),
         "chat": (parse_chat, {"messages": MSG})}
QWEN_LIKE = {"bos_token_id": 1, "eos_token_id": [2, 3], "pad_token_id": 0, "do_sample": True,
             "temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05,
             "transformers_version": "4.45.0"}


def model_dir(path: Path, generation: dict | None) -> Path:
    """A directory standing for an HF model: only generation_config.json matters here."""
    path.mkdir(parents=True, exist_ok=True)
    if generation is not None:
        (path / "generation_config.json").write_text(json.dumps(generation))
    return path


def gguf_file(path: Path, **sampling) -> Path:
    """A GGUF file holding only metadata, `sampling` as general.sampling.* keys."""
    w = GGUFWriter(str(path), "llama")
    for key, value in sampling.items():
        if isinstance(value, float):
            w.add_float32(f"general.sampling.{key}", value)
        else:
            w.add_int32(f"general.sampling.{key}", value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# -- the resolver ------------------------------------------------------------------------------

def test_auto_reads_the_models_generation_config(tmp_path):
    d = GenerationDefaults.load(model_dir(tmp_path, QWEN_LIKE), "auto")
    assert d.values == {"temperature": 0.7, "top_p": 0.8, "top_k": 20,
                        "repetition_penalty": 1.05}
    assert d.max_tokens is None and d.max_tokens_limit is None
    assert d.ignored == ("do_sample",)  # token ids and bookkeeping are not reported
    assert str(tmp_path / "generation_config.json") in d.source
    assert "temperature=0.7" in d.describe() and str(tmp_path) in d.describe()
    assert GenerationDefaults.load(tmp_path) == d  # auto is the default mode


def test_auto_without_a_generation_config_gives_none(tmp_path):
    d = GenerationDefaults.load(model_dir(tmp_path, None), "auto")
    assert d.values == {} and "none" in d.describe()
    only_ids = GenerationDefaults.load(model_dir(tmp_path / "ids", {"eos_token_id": 2}))
    assert only_ids.values == {} and only_ids.ignored == ()


def test_vllm_ignores_the_models_generation_config(tmp_path):
    d = GenerationDefaults.load(model_dir(tmp_path, QWEN_LIKE), "vllm")
    assert d == GenerationDefaults(source="--generation-config vllm")
    assert d.apply({"temperature": None, "top_p": None}) == {"temperature": 1.0, "top_p": 1.0}


def test_a_directory_or_file_replaces_the_models(tmp_path):
    model = model_dir(tmp_path / "model", QWEN_LIKE)
    other = model_dir(tmp_path / "other", {"temperature": 0.3, "max_new_tokens": 64})
    d = GenerationDefaults.load(model, str(other))
    assert d.values == {"temperature": 0.3, "max_tokens": 64}  # nothing of the model's
    assert d.max_tokens_limit == 64  # vLLM: a directory's max_new_tokens caps every request
    assert GenerationDefaults.load(model, str(other / "generation_config.json")).values == \
        d.values
    with pytest.raises(ValueError, match="no generation_config.json"):
        GenerationDefaults.load(model, str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="no generation_config.json"):
        GenerationDefaults.load(model, str(model_dir(tmp_path / "empty", None)))


def test_max_new_tokens_is_the_default_max_tokens(tmp_path):
    d = GenerationDefaults.load(model_dir(tmp_path, {"max_new_tokens": 256}))
    assert d.max_tokens == 256 and d.max_tokens_limit is None  # the model's own: no cap
    assert d.max_tokens_for(None, 16) == 256 and d.max_tokens_for(1000, 16) == 1000
    assert GenerationDefaults().max_tokens_for(None, 16) == 16


def test_overrides_override_and_extend(tmp_path):
    model = model_dir(tmp_path, QWEN_LIKE)
    d = GenerationDefaults.load(model, "auto", '{"temperature": 0.1, "min_p": 0.05}')
    assert d.values == {"temperature": 0.1, "top_p": 0.8, "top_k": 20, "min_p": 0.05,
                        "repetition_penalty": 1.05}
    assert "--override-generation-config" in d.source and "generation_config.json" in d.source
    alone = GenerationDefaults.load(model, "vllm", '{"top_k": 5}')  # vllm: the override only
    assert alone.values == {"top_k": 5} and alone.source == "--override-generation-config"
    capped = GenerationDefaults.load(model, "vllm", '{"max_new_tokens": 8}')
    assert capped.max_tokens == capped.max_tokens_limit == 8
    assert capped.max_tokens_for(None, 16) == 8 and capped.max_tokens_for(100, 16) == 8
    assert capped.max_tokens_for(None, None) == 8  # chat's "up to the context", capped
    assert GenerationDefaults().max_tokens_for(None, None) is None
    assert GenerationDefaults.load(model, "auto", "").values == \
        GenerationDefaults.load(model).values
    unset = GenerationDefaults.load(model, "auto", '{"temperature": null}')
    assert unset.temperature == 0.7  # null: no override (vLLM skips None values)


@pytest.mark.parametrize(("override", "match"), [
    ("{bad", "not valid JSON"),
    ("[1, 2]", "must be a JSON object"),
    ('{"temperature": -1}', "temperature must be >= 0"),
    ('{"top_p": 0}', "top_p must be in"),
    ('{"top_k": 1.5}', "top_k must be an integer"),
    ('{"max_new_tokens": 0}', "max_new_tokens must be at least 1"),
    ('{"temperature": "hot"}', "temperature must be a number"),
    ('{"temperature": true}', "temperature must be a number"),
    ('{"repetition_penalty": 0}', "repetition_penalty must be > 0"),
])
def test_bad_overrides_fail_with_one_clear_line(tmp_path, override, match):
    with pytest.raises(ValueError, match=match) as info:
        GenerationDefaults.load(model_dir(tmp_path, None), "auto", override)
    assert "\n" not in str(info.value)


def test_bad_generation_config_files_fail(tmp_path):
    broken = model_dir(tmp_path / "broken", None)
    (broken / "generation_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        GenerationDefaults.load(broken)
    with pytest.raises(ValueError, match="--generation-config .*not valid JSON"):
        GenerationDefaults.load(tmp_path, str(broken))
    bad = model_dir(tmp_path / "bad", {"top_p": 2})
    with pytest.raises(ValueError, match=r"generation_config.json.*top_p must be in \(0, 1\]"):
        GenerationDefaults.load(bad)
    assert GenerationDefaults.load(bad, "vllm").values == {}  # vllm never reads it


def test_unknown_keys_are_ignored_and_reported(tmp_path):
    d = GenerationDefaults.load(model_dir(tmp_path, {"temperature": 0.5, "num_beams": 4}),
                                "auto", '{"typical_p": 0.9, "max_length": 100}')
    assert d.values == {"temperature": 0.5}
    assert d.ignored == ("max_length", "num_beams", "typical_p")
    assert d.describe().endswith("; keys ignored: max_length, num_beams, typical_p")


def test_engine_config_rejects_a_malformed_override():
    with pytest.raises(ValueError, match="--override-generation-config is not valid JSON"):
        EngineConfig(override_generation_config="{bad")
    with pytest.raises(ValueError, match="--generation-config"):
        EngineConfig(generation_config="")


def test_gguf_general_sampling_metadata(tmp_path):
    path = gguf_file(tmp_path / "m.gguf", temp=0.6, top_k=40, top_p=0.95, min_p=0.05,
                     penalty_repeat=1.1, mirostat=0)
    d = GenerationDefaults.load(path)
    assert d.values == {"temperature": 0.6, "top_p": 0.95, "top_k": 40, "min_p": 0.05,
                        "repetition_penalty": 1.1}
    assert d.ignored == ("mirostat",) and "general.sampling" in d.source
    assert GenerationDefaults.load(path, "vllm").values == {}
    assert GenerationDefaults.load(gguf_file(tmp_path / "plain.gguf")).values == {}


def test_the_default_model_gets_its_model_cards_sampling(tmp_path):
    from pipellm.shared.default_model import FILE_NAME

    d = GenerationDefaults.load(gguf_file(tmp_path / FILE_NAME))
    assert d.values == {"temperature": 0.2, "top_p": 0.9}
    assert "SmolLM2-135M-Instruct model card" in d.source
    assert GenerationDefaults.load(tmp_path / FILE_NAME, "vllm").values == {}
    (tmp_path / "own").mkdir()
    own = GenerationDefaults.load(gguf_file(tmp_path / "own" / FILE_NAME, temp=0.5))
    assert own.values == {"temperature": 0.5, "top_p": 0.9}  # the file's own metadata wins


# -- requests ----------------------------------------------------------------------------------

DEFAULTS = GenerationDefaults(temperature=0.0, top_p=0.9, top_k=20, min_p=0.1,
                              repetition_penalty=1.2, max_tokens=7)


@pytest.mark.parametrize("kind", PARSE)
def test_unset_fields_take_the_models_defaults(kind):
    parse, body = PARSE[kind]
    req = parse(body, "m", defaults=DEFAULTS)
    p = req.params
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty, p.max_tokens) == (
        0.0, 0.9, 20, 0.1, 1.2, 7)
    assert not req.max_tokens_given
    nulls = parse({**body, "temperature": None, "top_p": None, "max_tokens": None}, "m",
                  defaults=DEFAULTS).params
    assert nulls == p  # null is unset


@pytest.mark.parametrize("kind", PARSE)
def test_fields_the_request_sets_win(kind):
    parse, body = PARSE[kind]
    given = {"temperature": 1.3, "top_p": 0.5, "top_k": 3, "min_p": 0.0,
             "repetition_penalty": 1.0, "max_tokens": 11}
    p = parse({**body, **given}, "m", defaults=DEFAULTS).params
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty, p.max_tokens) == (
        1.3, 0.5, 3, 0.0, 1.0, 11)
    partly = parse({**body, "temperature": 0.8}, "m", defaults=DEFAULTS).params
    assert (partly.temperature, partly.top_p, partly.max_tokens) == (0.8, 0.9, 7)


@pytest.mark.parametrize("kind", PARSE)
def test_without_model_defaults_requests_get_the_apis(kind):
    parse, body = PARSE[kind]
    p = parse(body, "m").params
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty) == (
        1.0, 1.0, 0, 0.0, 1.0)
    assert p == SamplingParams(max_tokens=p.max_tokens)


@pytest.mark.parametrize("kind", PARSE)
def test_a_cap_lowers_requested_max_tokens(kind):
    parse, body = PARSE[kind]
    cap = GenerationDefaults(max_tokens=5, max_tokens_limit=5)
    assert parse({**body, "max_tokens": 100}, "m", defaults=cap).params.max_tokens == 5
    assert parse({**body, "max_tokens": 2}, "m", defaults=cap).params.max_tokens == 2


def test_chat_default_max_tokens_is_lowered_to_the_context(demo_model_dir):
    """Chat without max_tokens: the model's default, but no more than the context leaves."""
    from pipellm.services.gateway.app import Gateway
    from pipellm.services.tokenizer.service import Tokenizer

    tok = Tokenizer(EngineConfig(model=str(demo_model_dir), max_model_len=64))
    gw = type("G", (), {"seeds": None, "svc": type("S", (), {"addr": lambda self, n: "x"})()})
    inflight = type("I", (), {"arrival": 0.0})

    def prepared(content: str, defaults: GenerationDefaults) -> tuple[int, int]:
        req = parse_chat({"messages": [{"role": "user", "content": content}]}, "m",
                         defaults=defaults)
        (one,) = Gateway._tokenize_requests(gw, "r", req, inflight)
        (gen,) = tok.prepare(one)
        return gen.params.max_tokens, len(gen.prompt_ids)

    assert prepared("hi", GenerationDefaults(max_tokens=5))[0] == 5
    max_tokens, prompt = prepared("hi", GenerationDefaults())
    assert max_tokens == 64 - prompt  # no default: the whole room
    max_tokens, prompt = prepared("word " * 12, GenerationDefaults(max_tokens=50))
    assert max_tokens == 64 - prompt < 50  # a default beyond the room: the room, not a 400


def test_run_batch_applies_the_defaults(demo_model_dir):
    from pipellm.services.compute.backend import build_engine
    from pipellm.services.run_batch import run_batch
    from pipellm.services.tokenizer.service import Tokenizer
    from pipellm.shared.tokenizer import decode, encode

    cfg = EngineConfig(model=str(demo_model_dir), kv_cache_tokens=4096)
    engine, tok = build_engine(cfg), Tokenizer(cfg)
    lines = [json.dumps({"custom_id": "c", "url": "/v1/completions",
                         "body": {"prompt": "The quick brown fox", "ignore_eos": True}}),
             json.dumps({"custom_id": "t", "url": "/v1/completions",
                         "body": {"prompt": "The quick brown fox", "ignore_eos": True,
                                  "max_tokens": 5}}),
             json.dumps({"custom_id": "chat", "url": "/v1/chat/completions",
                         "body": {"messages": MSG, "ignore_eos": True}})]
    out = io.StringIO()
    run_batch(engine, tok, "demo", lines, out, progress=None,
              defaults=GenerationDefaults(temperature=0.0, max_tokens=3))
    got = {r["custom_id"]: r["response"]["body"] for r in map(json.loads, out.getvalue().split(
        "\n")[:-1])}
    assert [got[k]["usage"]["completion_tokens"] for k in ("c", "t", "chat")] == [3, 5, 3]
    greedy = engine.generate([encode(tok.tok, "The quick brown fox")],
                             SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert got["c"]["choices"][0]["text"] == decode(tok.tok, greedy[0].output_ids)


def test_serve_fails_at_start_up_on_a_bad_setting(tmp_path, demo_model_dir, capsys):
    from pipellm.services.cli import main

    for flags in (["--override-generation-config", "{bad"],
                  ["--generation-config", str(tmp_path / "nowhere")],
                  ["--override-generation-config", '{"temperature": -2}']):
        assert main(["serve", str(demo_model_dir), "--port", "1", *flags]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("pipellm: error: ")
        assert "generation" in err[0] or "temperature" in err[0]


# -- a real server -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def greedy_model(demo_model_dir, tmp_path_factory) -> Path:
    """The demo model whose generation_config.json asks for greedy decoding and 3 tokens."""
    path = tmp_path_factory.mktemp("gc") / "greedy-demo"
    shutil.copytree(demo_model_dir, path)
    gen = json.loads((path / "generation_config.json").read_text())
    gen.update(temperature=0.0, max_new_tokens=3, do_sample=False)
    (path / "generation_config.json").write_text(json.dumps(gen))
    return path


def _completion(stack, **body) -> dict:
    status, answer = stack.post("/v1/completions", {"prompt": "The quick brown fox",
                                                    "ignore_eos": True, **body})
    assert status == 200, answer
    return answer


def test_server_applies_the_models_generation_config(greedy_model):
    from tests.stack import Stack

    auto = Stack(greedy_model).start()
    try:
        first, second = _completion(auto, seed=1), _completion(auto, seed=2)
        assert first["usage"]["completion_tokens"] == 3  # max_new_tokens
        assert first["choices"][0]["text"] == second["choices"][0]["text"]  # greedy
        assert _completion(auto, max_tokens=5)["usage"]["completion_tokens"] == 5
        status, chat = auto.post("/v1/chat/completions", {"messages": MSG, "ignore_eos": True})
        assert status == 200 and chat["usage"]["completion_tokens"] == 3
        logs = auto.wait_for_log("sampling defaults for requests that leave them unset: "
                                 "temperature=0.0, max_tokens=3, from ")
        assert "keys ignored: do_sample" in logs
    finally:
        auto.stop()
    plain = Stack(greedy_model, "--generation-config", "vllm").start()
    try:
        answer = _completion(plain, seed=1)
        assert answer["usage"]["completion_tokens"] == 16  # the API's default
        greedy = _completion(plain, temperature=0, max_tokens=3)
        assert greedy["choices"][0]["text"] == first["choices"][0]["text"]
        plain.wait_for_log("sampling defaults: none from the model (--generation-config vllm)")
    finally:
        plain.stop()


def test_max_tokens_is_fitted_to_the_context_once_the_prompt_is_known():
    """None: the room; a default is lowered to it; the client's own value beyond it is an
    error, as is a min_tokens beyond it."""
    from pipellm.shared.sampling import InvalidParams

    assert SamplingParams(max_tokens=None).fit_context(10, 64).max_tokens == 54
    assert SamplingParams(max_tokens=100).fit_context(10, 64, lower=True).max_tokens == 54
    assert SamplingParams(max_tokens=5).fit_context(10, 64, lower=True).max_tokens == 5
    same = SamplingParams(max_tokens=54)
    assert same.fit_context(10, 64) is same
    with pytest.raises(InvalidParams, match="maximum context length is 64 tokens"):
        SamplingParams(max_tokens=55).fit_context(10, 64)
    with pytest.raises(InvalidParams):
        SamplingParams(max_tokens=None, min_tokens=60).fit_context(10, 64)
