"""What vLLM users expect of the server: its flag names, `serve MODEL`, --help that explains
every flag, the API key and CORS, /tokenize, /detokenize, /version, /ping, --chat-template and
--seed. The gateway runs in-process on a real Redis and real sockets; the official openai client
where it applies."""

from __future__ import annotations

import argparse

import openai
import pytest

from pipellm.services import cli
from pipellm.shared.chat_template import load_chat_template
from pipellm.shared.config import EngineConfig, ServiceConfig
from pipellm.shared.tokenizer import encode, load_tokenizer
from pipellm.shared.tool_prompt import with_tools
from tests.gateway_harness import run_gateway


def with_gateway(demo_model_dir, url, body, engine=None, **svc):
    return run_gateway(engine or EngineConfig(model=str(demo_model_dir)), url, body, **svc)


# -- the command line -----------------------------------------------------------------------
def subparser(name: str) -> argparse.ArgumentParser:
    action = next(a for a in cli.build_parser()._actions
                  if isinstance(a, argparse._SubParsersAction))
    return action.choices[name]


def test_every_serve_flag_has_a_help_text_with_its_default_in_a_group():
    parser = subparser("serve")
    flags = [a for a in parser._actions if a.option_strings and a.dest != "help"]
    assert len(flags) > 40
    for a in flags:
        assert a.help and "(default: " in a.help, a.option_strings
    titles = {g.title for g in parser._action_groups if g._group_actions}
    assert {"model", "scheduling and KV cache", "server", "services wiring",
            "simulator (--backend sim)"} <= titles
    assert "other" not in titles


def test_vllm_flag_names_and_serve_model(demo_model_dir):
    args = subparser("serve").parse_args([
        str(demo_model_dir), "--max-num-seqs", "7", "--max-num-batched-tokens", "96",
        "--max-model-len", "100", "--gpu-memory-utilization", "0.5", "--dtype", "float32",
        "--served-model-name", "m", "--seed", "3", "--host", "0.0.0.0", "--port", "9"])
    engine, svc = cli._configs(args)
    assert (engine.model, engine.scheduler.max_running, engine.scheduler.max_batched_tokens) == (
        str(demo_model_dir), 7, 96)
    assert (engine.max_model_len, engine.gpu_memory_utilization, engine.dtype) == (
        100, 0.5, "float32")
    assert (svc.served_model_name, svc.seed, svc.host, svc.port) == ("m", 3, "0.0.0.0", 9)
    assert cli.build_parser().parse_args(["up", "--model", "x"]).command == "up"  # old name
    two = subparser("serve").parse_args([str(demo_model_dir), "--model", "/elsewhere"])
    with pytest.raises(ValueError, match="two models"):
        cli._configs(two)


def test_api_key_from_the_environment(monkeypatch, demo_model_dir):
    monkeypatch.setenv("PIPELLM_API_KEY", "from-env")
    args = subparser("serve").parse_args([str(demo_model_dir)])
    assert cli._configs(args)[1].api_key == "from-env"
    args = subparser("serve").parse_args([str(demo_model_dir), "--api-key", "flag"])
    assert cli._configs(args)[1].api_key == "flag"


def test_bad_allowed_origins_fail_at_start_up():
    with pytest.raises(ValueError, match="allowed-origins"):
        ServiceConfig(allowed_origins='["a", 1]')
    assert ServiceConfig(allowed_origins='["https://a.example/"]').origins() == {
        "https://a.example"}
    assert ServiceConfig(allowed_origins="").origins() == frozenset()


# -- API key and CORS -----------------------------------------------------------------------
def test_api_key_guards_the_api_but_not_health(demo_model_dir, redis_url):
    async def body(gw, client):
        base = str(client.make_url("/v1"))
        wrong = openai.AsyncOpenAI(base_url=base, api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError) as err:
            await wrong.models.list()
        right = openai.AsyncOpenAI(base_url=base, api_key="s3cret", max_retries=0)
        models = await right.models.list()
        bare = await client.post("/tokenize", json={"prompt": "hi"})
        x_key = await client.get("/v1/models", headers={"x-api-key": "s3cret"})  # Anthropic's
        x_wrong = await client.get("/v1/models", headers={"x-api-key": "s3cre"})
        assert (x_key.status, x_wrong.status) == (200, 401)
        return (err.value.status_code, err.value.body, [m.id for m in models.data],
                bare.status, (await client.get("/health")).status,
                (await client.get("/metrics")).status, (await client.get("/version")).status)

    status, err, ids, bare, health, metrics, version = with_gateway(
        demo_model_dir, redis_url, body, api_key="s3cret", served_model_name="demo")
    assert status == 401 and err["code"] == "invalid_api_key" and err["type"]
    assert ids == ["demo"] and bare == 401
    assert health == 503 and metrics == 200 and version == 200  # open (503: no services)


def test_cors_any_origin_by_default_and_preflight_without_key(demo_model_dir, redis_url):
    async def body(gw, client):
        pre = await client.options("/v1/chat/completions", headers={
            "Origin": "https://app.example", "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type"})
        get = await client.get("/v1/models", headers={"Origin": "https://app.example",
                                                      "Authorization": "Bearer k"})
        denied = await client.get("/v1/models", headers={"Origin": "https://app.example"})
        return pre.status, dict(pre.headers), get.status, dict(get.headers), dict(
            denied.headers), denied.status

    pre, pre_h, get, get_h, denied_h, denied = with_gateway(demo_model_dir, redis_url, body,
                                                            api_key="k")
    assert pre == 204 and pre_h["Access-Control-Allow-Origin"] == "*"
    assert "POST" in pre_h["Access-Control-Allow-Methods"]
    assert pre_h["Access-Control-Allow-Headers"] == "authorization, content-type"
    assert get == 200 and get_h["Access-Control-Allow-Origin"] == "*"
    assert denied == 401 and denied_h["Access-Control-Allow-Origin"] == "*"  # readable 401


def test_cors_only_listed_origins(demo_model_dir, redis_url):
    async def body(gw, client):
        ok = await client.get("/v1/models", headers={"Origin": "https://a.example"})
        other = await client.get("/v1/models", headers={"Origin": "https://evil.example"})
        plain = await client.get("/v1/models")
        return dict(ok.headers), dict(other.headers), other.status, dict(plain.headers)

    ok, other, status, plain = with_gateway(demo_model_dir, redis_url, body,
                                            allowed_origins="https://a.example")
    assert ok["Access-Control-Allow-Origin"] == "https://a.example" and ok["Vary"] == "Origin"
    assert "Access-Control-Allow-Origin" not in other and status == 200
    assert "Access-Control-Allow-Origin" not in plain


# -- utility endpoints ----------------------------------------------------------------------
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


def test_tokenize_detokenize_version_ping(demo_model_dir, redis_url):
    tok = load_tokenizer(demo_model_dir)
    text = "The quick brown fox, 123 times!"
    messages = [{"role": "user", "content": "Hello there"}]

    async def body(gw, client):
        out = {}
        for name, req in {"prompt": {"prompt": text},
                          "plain": {"prompt": text, "add_special_tokens": False},
                          "chat": {"messages": messages, "return_token_strs": True},
                          "chat_options": {"messages": messages, "prompt": None,
                                           "chat_template_kwargs": {"x": 1},
                                           "tools": TOOLS, "add_generation_prompt": False},
                          "continued": {"messages": messages + [
                              {"role": "assistant", "content": "Hi, I"}],
                              "continue_final_message": True},
                          "unknown": {"prompt": "a", "bogus": 1}}.items():
            r = await client.post("/tokenize", json=req)
            out[name] = (r.status, await r.json())
        r = await client.post("/detokenize", json={"tokens": out["plain"][1]["tokens"]})
        out["detok"] = (r.status, await r.json())
        r = await client.post("/detokenize", json={"tokens": out["prompt"][1]["tokens"]})
        out["detok_bos"] = (r.status, await r.json())
        out["version"] = await (await client.get("/version")).json()
        out["ping"] = ((await client.get("/ping")).status, (await client.post("/ping")).status)
        for name, req in {"both": {"prompt": "a", "messages": messages}, "neither": {},
                          "bad_id": {"tokens": [10**6]}, "model": {"prompt": "a", "model": "x"},
                          "null": {"prompt": None},
                          "bad_tools": {"messages": messages, "tools": [{"type": "x"}]}
                          }.items():
            path = "/detokenize" if "tokens" in req else "/tokenize"
            r = await client.post(path, json=req)
            out[name] = (r.status, (await r.json())["error"])
        return gw.max_model_len, out

    ctx, out = with_gateway(demo_model_dir, redis_url, body)
    assert out["prompt"][0] == 200
    assert out["prompt"][1] == {"count": len(encode(tok, text)), "max_model_len": ctx,
                                "tokens": encode(tok, text), "token_strs": None}
    assert out["plain"][1]["tokens"] == encode(tok, text, add_special_tokens=False)
    rendered = load_chat_template(demo_model_dir).render(messages, True)
    chat = out["chat"][1]
    assert chat["tokens"] == encode(tok, rendered, add_special_tokens=False)
    assert chat["token_strs"] == [tok.id_to_token(i) for i in chat["tokens"]]
    assert out["detok"] == (200, {"prompt": text})
    assert out["detok_bos"] == (200, {"prompt": tok.decode(encode(tok, text),
                                                           skip_special_tokens=False)})
    assert out["detok_bos"][1]["prompt"] != text  # special tokens kept, as vLLM's decode
    template = load_chat_template(demo_model_dir)
    tools = [{"type": "function", "function": {"name": "f", "description": "",
                                               "parameters": {"type": "object"}}}]
    assert out["chat_options"][1]["tokens"] == encode(tok, template.render(
        with_tools(messages, tools), False, None, {"x": 1}), add_special_tokens=False)
    continued = messages + [{"role": "assistant", "content": "Hi, I"}]
    assert out["continued"][1]["tokens"] == encode(tok, template.render(
        continued, False, continue_final=True), add_special_tokens=False)
    assert out["unknown"][0] == 200  # ignored, as vLLM does
    assert out["version"]["version"] and out["ping"] == (503, 503)  # no services: /health's
    assert out["both"][0] == out["neither"][0] == out["bad_id"][0] == 400
    assert out["bad_id"][1]["param"] == "tokens"
    assert out["model"][0] == 404 and out["null"][0] == out["bad_tools"][0] == 400


def test_chat_template_flag_overrides_the_models(demo_model_dir, redis_url, tmp_path):
    inline = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    as_file = tmp_path / "t.jinja"
    as_file.write_text("[{{ messages[0]['content'] }}]")
    tok = load_tokenizer(demo_model_dir)
    messages = [{"role": "user", "content": "hey"}]
    for template, rendered in ((inline, "<user>hey"), (str(as_file), "[hey]")):
        async def body(gw, client):
            r = await client.post("/tokenize", json={"messages": messages})
            return (await r.json())["tokens"]

        engine = EngineConfig(model=str(demo_model_dir), chat_template=template)
        tokens = with_gateway(demo_model_dir, redis_url, body, engine=engine)
        assert tokens == encode(tok, rendered, add_special_tokens=False)
    with pytest.raises(ValueError, match="neither a file nor a template"):
        load_chat_template(demo_model_dir, str(tmp_path / "missing.jinja"))


def test_server_seed_makes_unseeded_requests_reproducible(demo_model_dir, redis_url):
    from pipellm.services.gateway import protocol

    async def body(gw, client):
        req = protocol.parse_completion({"prompt": "x", "temperature": 1.0}, gw.model_name)
        return [gw._tokenize_requests(f"r{i}", req, gw.registry.add(f"r{i}", 1))[0].params.seed
                for i in range(3)]

    a = with_gateway(demo_model_dir, redis_url, body, seed=5)
    b = with_gateway(demo_model_dir, redis_url, body, seed=5)
    c = with_gateway(demo_model_dir, redis_url, body)
    assert a == b and len(set(a)) == 3 and c != a
