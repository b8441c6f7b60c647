"""The pooling runner's pieces without sockets: the /v1/embeddings body's parsing and answer,
the tokenizer's preparation, compute's EmbedCore (on a fake engine), the messages on the wire,
and the --runner / --convert settings."""

from __future__ import annotations

import base64
from array import array

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from pipellm.services.cli import build_parser
from pipellm.services.compute.embed_core import EmbedCore
from pipellm.services.compute.pooling import NoKVRoom
from pipellm.services.gateway.embed_encoding import Encoding
from pipellm.services.gateway.embeddings_api import answer
from pipellm.services.gateway.embeddings_request import (
    MAX_INPUTS,
    EmbeddingSettings,
    EmbeddingsRequest,
    parse_embeddings,
)
from pipellm.services.gateway.errors import APIError
from pipellm.services.tokenizer.embed import EmbedInputError, prepare_embed
from pipellm.shared import codec
from pipellm.shared.config import EngineConfig
from pipellm.shared.messages import EmbedRequest, EmbedResult
from pipellm.shared.pooling import PoolingConfig
from pipellm.shared.sampling import InvalidParams
from pipellm.shared.settings import config_from_args, with_settings

SETTINGS = EmbeddingSettings(True, PoolingConfig(matryoshka_dims=(16, 32, 64)), 64, 100)


def parse(body: dict, strict: bool = True) -> EmbeddingsRequest:
    return parse_embeddings({"model": "m", **body}, "m", SETTINGS, max_text_bytes=1000,
                            ignored=None if strict else [])


def rejects(body: dict, param: str, match: str = "") -> APIError:
    with pytest.raises(APIError) as info:
        parse(body)
    assert (info.value.status, info.value.param) == (400, param), info.value
    assert match in info.value.message
    return info.value


def test_the_four_input_shapes():
    assert parse({"input": "hi"}).texts == ("hi",)
    assert parse({"input": ["a", ""]}).texts == ("a", "")  # the tokenizer judges "" (BOS?)
    assert parse({"input": ["a", "b"]}).texts == ("a", "b")
    r = parse({"input": [1, 2, 3]})
    assert (r.texts, r.ids, r.count) == (None, ((1, 2, 3),), 1)
    assert parse({"input": [[1], [2, 3]]}).ids == ((1,), (2, 3))
    r = parse({"input": "x", "encoding_format": "base64", "dimensions": 16,
               "truncate_prompt_tokens": -1, "user": "someone"})
    assert (r.encoding.format, r.dimensions, r.truncate_prompt_tokens) == ("base64", 16, -1)
    assert parse({"input": "x", "truncate_prompt_tokens": 100}).truncate_prompt_tokens == 100
    assert parse({"input": "x"}).add_special_tokens
    assert not parse({"input": "x", "add_special_tokens": False}).add_special_tokens
    r = parse({"input": "x"})
    assert (r.truncation_side, r.use_activation) == ("right", None)
    r = parse({"input": "x", "truncation_side": "left", "use_activation": False})
    assert (r.truncation_side, r.use_activation) == ("left", False)
    msg = r.message("id", "gw")
    assert (msg.texts, msg.truncation_side, msg.use_activation, msg.task) == (
        ["x"], "left", False, "embed")
    # vLLM's chat embeddings requests: one conversation or a batch, in messages or input
    hi = [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]
    for body in ({"messages": hi}, {"input": hi}, {"messages": [hi, hi[1:]]},
                 {"input": [hi, hi[1:]]}):
        r = parse({**body, "chat_template_kwargs": {"x": 1}})
        assert r.texts is None and r.ids is None and not r.add_special_tokens
        assert r.chat.conversations[0][1].content == "hi" and r.count == len(r.chat.conversations)
        msg = r.message("id", "gw")
        assert msg.conversations[0][0].role == "system" and msg.chat_template_kwargs == '{"x": 1}'
        assert not msg.add_generation_prompt and codec.decode(codec.encode(msg)) == msg
    assert parse({"input": ["a"] * MAX_INPUTS}).count == MAX_INPUTS


@pytest.mark.parametrize("body,param,match", [
    ({}, "input", "required"),
    ({"input": []}, "input", "empty"),
    ({"input": [[1], []]}, "input", "empty"),
    ({"input": ["a"] * (MAX_INPUTS + 1)}, "input", "2048"),
    ({"input": [[1]] * (MAX_INPUTS + 1)}, "input", "2048"),
    ({"input": ["a", [1]]}, "input", "string"),
    ({"input": [[1], "a"]}, "input", "token ids"),
    ({"input": [1, "a"]}, "input", "token id"),
    ({"input": [[1, -1]]}, "input", "token id"),
    ({"input": [1, 2.5]}, "input", "token id"),
    ({"input": 5}, "input", "must be a string"),
    ({"input": {"a": 1}}, "input", "must be a string"),
    ({"input": "x" * 1001}, "input", "1000 bytes"),
    ({"input": "x", "encoding_format": "hex"}, "encoding_format", "base64"),
    ({"input": "x", "embed_dtype": "int8"}, "embed_dtype", "bfloat16"),
    ({"input": "x", "endianness": "middle"}, "endianness", "native"),
    ({"input": "x", "dimensions": 0}, "dimensions", "at least 1"),
    ({"input": "x", "dimensions": 12}, "dimensions", "Matryoshka"),
    ({"input": "x", "dimensions": "16"}, "dimensions", "integer"),
    ({"input": "x", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens", "-1"),
    ({"input": "x", "truncate_prompt_tokens": -2}, "truncate_prompt_tokens", "at least"),
    ({"input": "x", "truncate_prompt_tokens": 101}, "truncate_prompt_tokens", "max_model_len"),
    ({"input": "x", "stream": True}, "stream", "Unrecognized"),
    ({"input": "x", "add_special_tokens": 1}, "add_special_tokens", "boolean"),
    ({"input": "x", "truncation_side": "middle"}, "truncation_side", "'left' or 'right'"),
    ({"input": "x", "use_activation": "yes"}, "use_activation", "boolean"),
    ({"input": "x", "normalize": False}, "normalize", "use_activation"),
    ({"messages": [{"role": "user", "content": "a"}], "input": "x"}, "messages", "not both"),
    ({"messages": "a"}, "messages", "conversation"),
    ({"messages": [[{"role": "user"}]]}, "messages[0].content", "required"),
    ({"messages": [{"role": "user", "content": "a"}], "chat_template": "x"}, "chat_template",
     "not supported"),
    ({"input": [{"role": "user", "content": "a"}], "add_generation_prompt": True,
      "continue_final_message": True}, "continue_final_message", "both"),
])
def test_bad_bodies_are_400s_naming_the_field(body, param, match):
    rejects(body, param, match)


def test_unknown_model_unknown_keys_and_widths():
    with pytest.raises(APIError) as info:
        parse({"input": "x", "model": "other"})
    assert info.value.status == 404
    assert parse({"input": "x", "stream": True}, strict=False).texts == ("x",)
    anywidth = EmbeddingSettings(True, PoolingConfig(), 64, 100)
    ok = parse_embeddings({"input": "x", "dimensions": 12}, "m", anywidth, max_text_bytes=99)
    assert ok.dimensions == 12
    with pytest.raises(APIError, match="at most the model's width 64"):
        parse_embeddings({"input": "x", "dimensions": 65}, "m", anywidth, max_text_bytes=99)


def test_answer_float_and_base64():
    rows = np.array([[0.5, -1.25, 3.0], [1e-3, 2.0, -0.0]], dtype=np.float32)
    result = EmbedResult("r", array("f", rows.ravel()), 3, array("i", [4, 7]))
    req = parse({"input": ["a", "b"]})
    out = answer(result, req)
    assert out["object"] == "list" and out["model"] == "m" and out["id"] == "r"
    assert isinstance(out["created"], int)
    assert out["usage"] == {"prompt_tokens": 11, "total_tokens": 11, "completion_tokens": 0}
    assert [d["index"] for d in out["data"]] == [0, 1]
    assert np.array_equal(np.array([d["embedding"] for d in out["data"]], np.float32), rows)
    b64 = answer(result, parse({"input": ["a", "b"], "encoding_format": "base64"}))
    decoded = [np.frombuffer(base64.b64decode(d["embedding"]), "<f4") for d in b64["data"]]
    assert np.array_equal(np.stack(decoded), rows)
    assert Encoding("base64").json_value(np.ones(1, np.float32)) == base64.b64encode(
        b"\x00\x00\x80\x3f").decode()


def test_tokenizer_prepares_ids(demo_model_dir):
    tok = Tokenizer.from_file(str(demo_model_dir / "tokenizer.json"))
    texts = ["hello world", "a b c d e f g"]
    req = prepare_embed(tok, EmbedRequest("r", "addr", texts=texts), 100, 1000)
    assert req.texts is None
    assert [list(i) for i in req.inputs] == [tok.encode(t).ids for t in texts]
    assert all(i.typecode == "i" for i in req.inputs)
    bare = prepare_embed(tok, EmbedRequest("r", "a", texts=texts, add_special_tokens=False),
                         100, 1000)
    assert [list(i) for i in bare.inputs] == [tok.encode(t, add_special_tokens=False).ids
                                              for t in texts]
    assert len(bare.inputs[0]) < len(req.inputs[0])  # the demo tokenizer adds BOS
    long = tok.encode(texts[1]).ids
    cut = prepare_embed(tok, EmbedRequest("r", "a", texts=texts[1:], truncate_prompt_tokens=3),
                        100, 1000)
    assert list(cut.inputs[0]) == long[:3]  # the pooling runner keeps the first tokens
    tail = prepare_embed(tok, EmbedRequest("r", "a", texts=texts[1:], truncate_prompt_tokens=3,
                                           truncation_side="left"), 100, 1000)
    assert list(tail.inputs[0]) == long[-3:]
    whole = prepare_embed(tok, EmbedRequest("r", "a", inputs=[array("i", range(9))],
                                            truncate_prompt_tokens=-1), 5, 1000)
    assert list(whole.inputs[0]) == [0, 1, 2, 3, 4]
    with pytest.raises(EmbedInputError, match="maximum context length is 5"):
        prepare_embed(tok, EmbedRequest("r", "a", inputs=[array("i", range(6))]), 5, 1000)
    with pytest.raises(EmbedInputError, match="vocabulary"):
        prepare_embed(tok, EmbedRequest("r", "a", inputs=[array("i", [1, 1000])]), 5, 1000)
    with pytest.raises(EmbedInputError, match="no tokens"):
        prepare_embed(tok, EmbedRequest("r", "a", inputs=[array("i")]), 5, 1000)


def test_tokenizer_renders_conversations(demo_model_dir):
    """Conversations render with the model's chat template and tokenize as transformers'
    apply_chat_template does (no special tokens added: the template writes them)."""
    from transformers import AutoTokenizer

    from pipellm.shared.chat_template import load_chat_template
    from pipellm.shared.messages import ChatMessage

    tok = Tokenizer.from_file(str(demo_model_dir / "tokenizer.json"))
    hf = AutoTokenizer.from_pretrained(demo_model_dir)
    template = load_chat_template(demo_model_dir)
    convs = [[ChatMessage("system", "be brief"), ChatMessage("user", "a river")],
             [ChatMessage("user", "the sea")]]
    req = prepare_embed(tok, EmbedRequest("r", "a", conversations=convs, add_special_tokens=False),
                        100, 1000, template)
    want = [hf.apply_chat_template([{"role": m.role, "content": m.content} for m in c],
                                   tokenize=True, return_dict=False) for c in convs]
    assert [list(i) for i in req.inputs] == want and req.conversations is None
    prompt = prepare_embed(tok, EmbedRequest("r", "a", conversations=convs[1:],
                                             add_special_tokens=False,
                                             add_generation_prompt=True), 100, 1000, template)
    assert list(prompt.inputs[0]) == hf.apply_chat_template(
        [{"role": "user", "content": "the sea"}], tokenize=True, add_generation_prompt=True,
        return_dict=False)
    with pytest.raises(EmbedInputError, match="no chat template") as e:
        prepare_embed(tok, EmbedRequest("r", "a", conversations=convs), 100, 1000, None)
    assert e.value.param == "messages"


class FakeEngine:
    """embed: each prompt's vector is [len, first id, 0, ...] truncated to `dimensions`; a
    prompt holding id 13 is refused (as the engine refuses a bad prompt)."""

    def __init__(self):
        self.calls = []

    def embed(self, prompts, dimensions=None, normalize=None):
        self.calls.append((len(prompts), dimensions) if normalize is None
                          else (len(prompts), dimensions, normalize))
        if any(13 in p for p in prompts):
            raise InvalidParams("input", "unlucky token")
        if any(14 in p for p in prompts):
            raise NoKVRoom("no 3 free KV slots for a pooled prompt")
        if any(15 in p for p in prompts):
            raise RuntimeError("a bug")
        out = torch.zeros(len(prompts), 4)
        for i, p in enumerate(prompts):
            out[i, 0], out[i, 1] = len(p), p[0]
        return out[:, :dimensions] if dimensions else out


def test_embed_core_batches_by_width_and_isolates_errors():
    engine = FakeEngine()
    core = EmbedCore(engine, budget=100)
    ids = lambda *p: [array("i", x) for x in p]  # noqa: E731
    core.submit(EmbedRequest("a", "gw1", ids([1, 2], [3])))
    core.submit(EmbedRequest("b", "gw2", ids([5, 6, 7]), dimensions=2))
    core.submit(EmbedRequest("c", "gw1", ids([9])))
    core.submit(EmbedRequest("raw", "gw1", ids([8]), use_activation=False))
    out = dict((r.request_id, (to, r)) for to, r in core.run())
    # a and c in one call; raw (unnormalized) in its own
    assert sorted(engine.calls, key=str) == [(1, 2), (1, None, False), (3, None)]
    assert not core.has_work()
    to, a = out["a"]
    assert to == "gw1" and a.dim == 4 and list(a.num_tokens) == [2, 1]
    assert list(a.vectors)[:2] == [2, 1] and list(a.vectors)[4:6] == [1, 3]
    assert out["b"][0] == "gw2" and out["b"][1].dim == 2 and list(out["b"][1].vectors) == [3, 5]
    assert list(out["c"][1].vectors)[:2] == [1, 9]
    core.submit(EmbedRequest("ok", "gw", ids([1])))
    core.submit(EmbedRequest("bad", "gw", ids([13])))
    core.submit(EmbedRequest("full", "gw", ids([14])))
    out = {r.request_id: r for _, r in core.run()}
    assert out["ok"].error is None and list(out["ok"].vectors)[:2] == [1, 1]
    assert (out["bad"].error_status, out["bad"].error_param) == (400, "input")
    assert (out["full"].error_status, out["full"].error_param) == (400, "input")
    assert "KV" in out["full"].error
    core.submit(EmbedRequest("bug", "gw", ids([15])))
    (_, bug), = core.run()
    assert (bug.error_status, bug.error) == (500, "internal error in compute")


def test_embed_core_takes_a_forwards_worth_at_a_time():
    """A run takes the oldest requests up to the budget of tokens (the first one even when it
    alone is over it) and leaves the rest queued, so the first answers leave after their own
    forward."""
    engine = FakeEngine()
    core = EmbedCore(engine, budget=5)
    ids = lambda *p: [array("i", x) for x in p]  # noqa: E731
    for name, prompts in (("a", ids([1, 2], [3])), ("b", ids([4, 5])), ("c", ids([6] * 9)),
                          ("d", ids([7]))):
        core.submit(EmbedRequest(name, "gw", prompts))
    assert [r.request_id for _, r in core.run()] == ["a", "b"]  # 3 + 2 tokens
    assert core.has_work() and engine.calls == [(3, None)]
    assert [r.request_id for _, r in core.run()] == ["c"]  # 9 tokens: alone, over the budget
    assert [r.request_id for _, r in core.run()] == ["d"]
    assert not core.has_work()


def test_messages_round_trip():
    req = EmbedRequest("r", "ipc://x", [array("i", [1, 2]), array("i", [3])], dimensions=8)
    assert codec.decode(codec.encode(req)) == req
    texts = EmbedRequest("r", "ipc://x", texts=["a", "b"], truncate_prompt_tokens=-1)
    assert codec.decode(codec.encode(texts)) == texts
    res = EmbedResult("r", array("f", [0.5, -2.0]), 2, array("i", [3]))
    back = codec.decode(codec.encode(res))
    assert back == res and back.vectors.typecode == "f"
    err = EmbedResult("r", error="bad", error_status=400, error_param="input")
    assert codec.decode(codec.encode(err)) == err


def test_runner_and_convert_settings(monkeypatch):
    def engine(*argv) -> EngineConfig:
        args = build_parser().parse_args(["serve", *argv])
        return config_from_args(EngineConfig, args)

    assert not engine().pooling and engine().runner == "generate"
    assert engine("--runner", "pooling").pooling
    assert engine("--convert", "embed").pooling
    assert not engine("--convert", "none").pooling
    assert engine("--convert", "classify").pooling
    assert engine("--convert", "reward").pooling and engine("--convert", "reward").reward
    assert engine("--hf-overrides", '{"architectures": ["Qwen3ForSequenceClassification"]}'
                  ).pooling
    monkeypatch.setenv("PIPELLM_RUNNER", "pooling")
    assert engine().pooling
    for bad, match in ((dict(runner="draft"), "--runner must be one of"),
                       (dict(hf_overrides='{"architectures": ["X"]}'), "--runner pooling"),
                       (dict(runner="pooling", hf_overrides='{"vocab_size": 3}'),
                        "not supported"),
                       (dict(runner="pooling", hf_overrides="[1"), "not valid JSON"),
                       (dict(convert="reward", pooler_config='{"normalize": true}'),
                        "--pooler-config"),
                       (dict(convert="x"), "--convert must be one of"),
                       (dict(runner="pooling", backend="sim"), "--backend sim"),
                       (dict(runner="pooling", enable_prefix_caching=True), "prefix-caching"),
                       (dict(convert="embed", hidden_length=True), "--hidden-length")):
        with pytest.raises(ValueError, match=match):
            with_settings(EngineConfig(), **bad)
