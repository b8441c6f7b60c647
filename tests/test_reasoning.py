"""Reasoning parsers (pipellm/shared/reasoning.py): the split of whole outputs as vLLM's qwen3 and
deepseek_r1 parsers make it, the streaming split equal to it for every chunking, the
detokenizer's deltas (token by token, and a resumed choice that continues exactly where its
client is), and the gateway's fields: include_reasoning, separate_reasoning, reasoning in the
history, --default-chat-template-kwargs."""

from __future__ import annotations

import json
from array import array

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipellm.services.detokenizer.service import Detokenizer
from pipellm.services.gateway.chat_settings import ChatSettings
from pipellm.services.gateway.errors import APIError
from pipellm.services.gateway.protocol import parse_chat
from pipellm.shared.chat_template import template_message
from pipellm.shared.demo_model import build_demo_tokenizer
from pipellm.shared.messages import Resume, Route, StepOutput, Tokens
from pipellm.shared.reasoning import PARSERS, Splitter, parser, split

QWEN3, R1 = parser("qwen3"), parser("deepseek_r1")


@pytest.mark.parametrize("rule,text,want", [
    (QWEN3, "<think>\nplan</think>\n\nAnswer.", ("\nplan", "\n\nAnswer.")),
    (QWEN3, "Answer without thinking.", ("", "Answer without thinking.")),
    (QWEN3, "\n<think>cut off by max_tokens", ("cut off by max_tokens", "")),
    (QWEN3, "<thi", ("", "<thi")),  # not the marker after all: content
    (R1, "plan</think>Answer.", ("plan", "Answer.")),  # the template opened it
    (R1, "<think>plan</think>Answer.", ("plan", "Answer.")),
    (R1, "all reasoning, no end", ("all reasoning, no end", "")),
    (R1, "a</think>b</think>c", ("a", "b</think>c")),  # one end marker: the rest is content
    (QWEN3, "<think></think>", ("", "")),
])
def test_whole_outputs_split_as_vllms_parsers(rule, text, want):
    assert split(rule, text) == want


def test_sglangs_names_and_unknown_names():
    assert PARSERS["deepseek-r1"] is R1 and PARSERS["qwen3-thinking"].starts_in_reasoning
    with pytest.raises(ValueError, match="deepseek_r1"):
        parser("o1")


@settings(max_examples=300, deadline=None)
@given(st.sampled_from([QWEN3, R1]),
       st.lists(st.sampled_from(["<think>", "</think>", "<th", "ink>", "</", "a", " ", "\n",
                                 "think", ">"]), max_size=12),
       st.lists(st.integers(0, 60), max_size=6))
def test_streamed_split_equals_the_whole_split_for_every_chunking(rule, pieces, cuts):
    text = "".join(pieces)
    bounds = sorted({min(c, len(text)) for c in cuts})
    chunks = [text[a:b] for a, b in zip([0, *bounds], [*bounds, len(text)], strict=True)]
    s, got = Splitter(rule), ["", ""]
    for chunk in chunks:
        r, c = s.feed(chunk)
        got[0], got[1] = got[0] + r, got[1] + c
    r, c = s.flush()
    assert (got[0] + r, got[1] + c) == split(rule, text)


TEXT = "<think>The user wants a greeting.</think>\n\nHello there, friend."


def _deltas(tok, ids, route, start=0):
    detok = Detokenizer(tok, ttl_s=60)
    out = []
    for i, t in enumerate(ids[start:], start):
        fin = "stop" if i == len(ids) - 1 else None
        rec = Tokens(route.request_id, 1 + i, array("i", [t]), array("f", [-1.0]),
                     finish_reason=fin)
        res = detok.handle(StepOutput([route] if i == start else [], [rec]))
        out += res.deltas.get("gw", [])
    return out


def test_the_detokenizer_splits_token_by_token_and_resumes_exactly():
    tok = build_demo_tokenizer()
    ids = tok.encode(TEXT).ids
    route = Route("r:0", "gw", num_prompt=1, prompt_tail=array("i", [0]),
                  include_stop_str_in_output=True, reasoning_parser="qwen3")
    deltas = _deltas(tok, ids, route)
    reasoning, content = split(QWEN3, tok.decode(ids))
    assert reasoning.strip() and content.strip()
    assert "".join(d.reasoning for d in deltas) == reasoning
    assert "".join(d.text for d in deltas) == content
    for cut in range(1, len(ids)):  # a compute restart after `cut` tokens reached the client
        have = deltas[:cut]
        sent = sum(len(d.reasoning) + len(d.text) for d in have)
        resumed = Route(**{**route.__dict__, "request_id": "r:0:1",
                           "resume": Resume(0, 1, array("i", ids[:cut]), sent)})
        rest = _deltas(tok, ids, resumed, start=cut)
        assert "".join(d.reasoning for d in have + rest) == reasoning, cut
        assert "".join(d.text for d in have + rest) == content, cut


def _chat(body, reasoning_parser="", **kw):
    return parse_chat({"messages": [{"role": "user", "content": "hi"}], **body}, "m",
                      chat=ChatSettings(reasoning_parser=reasoning_parser, **kw))


def test_gateway_fields():
    req = _chat({}, reasoning_parser="qwen3")
    assert req.options["reasoning_parser"] == "qwen3" and req.shows_reasoning
    assert not _chat({"include_reasoning": False}, reasoning_parser="qwen3").shows_reasoning
    kept = _chat({"separate_reasoning": False}, reasoning_parser="qwen3")  # SGLang's
    assert kept.options["reasoning_parser"] == "" and not kept.shows_reasoning
    assert not _chat({}).shows_reasoning  # no parser on the server
    with pytest.raises(APIError, match="include_reasoning"):
        _chat({"include_reasoning": "yes"}, reasoning_parser="qwen3")
    thinking_off = _chat({}, template_kwargs={"enable_thinking": False, "x": 1})
    assert json.loads(thinking_off.options["chat_template_kwargs"]) == {
        "enable_thinking": False, "x": 1}
    mine = _chat({"chat_template_kwargs": {"enable_thinking": True}},
                 template_kwargs={"enable_thinking": False, "x": 1})  # the request's win
    assert json.loads(mine.options["chat_template_kwargs"]) == {"enable_thinking": True, "x": 1}


def test_reasoning_in_the_history_reaches_the_template():
    for key in ("reasoning_content", "reasoning"):
        req = _chat({"messages": [{"role": "user", "content": "q"},
                                  {"role": "assistant", "content": "a", key: "thought"},
                                  {"role": "user", "content": "more"}]})
        assert template_message(req.messages[1])["reasoning_content"] == "thought"
    none = _chat({"messages": [{"role": "assistant", "content": "a", "reasoning": None}]})
    assert none.messages[0].reasoning is None
    with pytest.raises(APIError, match="belongs to assistant messages"):
        _chat({"messages": [{"role": "user", "content": "q", "reasoning_content": "x"}]})
    with pytest.raises(APIError, match="must be a string"):
        _chat({"messages": [{"role": "assistant", "content": "a", "reasoning": 3}]})


def test_bad_server_flags_fail_at_start_up():
    from pipellm.shared.config import ServiceConfig

    with pytest.raises(ValueError, match="deepseek_r1"):
        ServiceConfig(reasoning_parser="o1")
    with pytest.raises(ValueError, match="JSON object"):
        ServiceConfig(default_chat_template_kwargs="[1]")
    svc = ServiceConfig(reasoning_parser="deepseek-r1",
                        default_chat_template_kwargs='{"enable_thinking": true}')
    assert ChatSettings.of(svc, None) == ChatSettings("hermes", "deepseek-r1",
                                                      {"enable_thinking": True})


def test_a_thinking_budget_forces_the_end_marker_token_by_token():
    from pipellm.services.compute.sampling import thinking_end_token
    from pipellm.shared.sampling import SamplingParams

    end = (7, 8, 9)
    p = SamplingParams(thinking_budget=4, thinking_end_ids=end)
    assert thinking_end_token(p, [1, 2, 3]) is None  # within the budget
    assert thinking_end_token(p, [1, 2, 3, 4]) == 7
    assert thinking_end_token(p, [1, 2, 3, 4, 7]) == 8  # the marker goes on where it stands
    assert thinking_end_token(p, [1, 2, 3, 4, 7, 8]) == 9
    assert thinking_end_token(p, [1, 7, 8, 9, 5, 6]) is None  # ended by itself
    opened = SamplingParams(thinking_budget=2, thinking_end_ids=end, thinking_start_ids=(5,))
    assert thinking_end_token(opened, [6, 6, 6]) is None  # never opened: nothing to end
    assert thinking_end_token(opened, [5, 6]) is None and thinking_end_token(opened,
                                                                              [5, 6, 6]) == 7
    assert not SamplingParams().reads_output and p.reads_output


def test_a_thinking_budget_ends_the_reasoning_through_the_engine(demo_model_dir):
    """The demo model (random weights) never writes </think> by itself: with a budget of 6
    the tokens right after the sixth are </think>'s, and the text splits there."""
    from pipellm.services.compute.backend import build_engine
    from pipellm.shared.config import EngineConfig
    from pipellm.shared.sampling import SamplingParams
    from pipellm.shared.settings import with_settings

    tok = build_demo_tokenizer()
    end = tuple(tok.encode("</think>", add_special_tokens=False).ids)
    engine = build_engine(with_settings(EngineConfig(), model=str(demo_model_dir),
                                        kv_cache_tokens=2048))
    params = SamplingParams(max_tokens=6 + len(end) + 4, temperature=0.8, seed=3,
                            ignore_eos=True, thinking_budget=6, thinking_end_ids=end)
    (seq,) = engine.generate([[1, 5, 9]], params)
    assert tuple(seq.output_ids[6 : 6 + len(end)]) == end
    reasoning, content = split(R1, tok.decode(seq.output_ids))
    assert "</think>" not in reasoning + content and content


def test_thinking_token_budget_needs_a_reasoning_parser():
    with pytest.raises(APIError, match="--reasoning-parser"):
        _chat({"thinking_token_budget": 10})
    assert _chat({"thinking_token_budget": 10}, reasoning_parser="qwen3").options[
        "thinking_token_budget"] == 10
