"""Constrained decoding in the engine, on the demo model (random weights: left alone it writes
noise, so every valid output below is the grammar's doing): regex, choice, JSON schema; the
mask obeyed token by token; logprobs stay the model's; max_tokens, min_tokens and ignore_eos;
preemption, a resumed request's replay, n choices with seeds; the compiler's cache and errors."""

from __future__ import annotations

import json

import jsonschema
import pytest
import regex as re
import torch

from pipellm.services.compute.backend import build_engine
from pipellm.services.compute.structured import GrammarState, mask_logits
from pipellm.shared.config import EngineConfig, SchedulerConfig
from pipellm.shared.grammar import GrammarError, GrammarSpec, model_compiler
from pipellm.shared.sampling import SamplingParams
from pipellm.shared.tokenizer import decode, encode, load_tokenizer

PROMPTS = ["The answer is", "Once upon a time", "JSON:", "a b c d"]
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8},
    "n": {"type": "integer", "minimum": 0, "maximum": 999},
    "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 3}},
    "required": ["name", "n", "tags"], "additionalProperties": False}


@pytest.fixture(scope="module")
def compiler(demo_model_dir):
    return model_compiler(str(demo_model_dir))


@pytest.fixture(scope="module")
def tok(demo_model_dir):
    return load_tokenizer(demo_model_dir)


def _engine(model_dir, **kw):
    sched = kw.pop("scheduler", SchedulerConfig())
    return build_engine(EngineConfig(model=str(model_dir), scheduler=sched, **kw))


def _run(engine, tok, compiler, spec: GrammarSpec, params: SamplingParams, prompts=PROMPTS,
         output_ids=None):
    grammar = compiler.compile(spec)
    seqs = []
    for i, p in enumerate(prompts):
        rid = engine.add_request(encode(tok, p), params, grammar=grammar,
                                 output_ids=output_ids[i] if output_ids else ())
        seqs.append(engine.requests[rid])
    while engine.has_work():
        engine.step()
    return [(decode(tok, s.output_ids), s.finish_reason, s) for s in seqs]


SAMPLED = SamplingParams(max_tokens=120, temperature=1.0, seed=7)


@pytest.mark.parametrize("pattern", [r"[0-9]{3}-[a-z]{2,4}", r"(yes|no), (red|blue)!"])
def test_regex_outputs_match(demo_model_dir, tok, compiler, pattern):
    out = _run(_engine(demo_model_dir), tok, compiler, GrammarSpec("regex", pattern), SAMPLED)
    for text, finish, _ in out:
        assert finish == "stop" and re.fullmatch(pattern, text), (text, finish)


def test_choice_is_one_of_the_strings(demo_model_dir, tok, compiler):
    choices = ["alpha", "beta gamma", "δ"]
    out = _run(_engine(demo_model_dir), tok, compiler,
               GrammarSpec("choice", json.dumps(choices)), SAMPLED)
    assert all(text in choices and finish == "stop" for text, finish, _ in out), out


@pytest.mark.parametrize("whitespace", ["any", "compact", "\\n?"])
def test_json_schema_outputs_validate(demo_model_dir, tok, compiler, whitespace):
    """"any", "compact" (disable_any_whitespace) or a whitespace_pattern (here: at most one
    newline between tokens)."""
    pattern = whitespace if whitespace not in ("any", "compact") else None
    spec = GrammarSpec("json_schema", json.dumps(SCHEMA), "compact" if whitespace == "compact"
                       else "any", whitespace_pattern=pattern)
    out = _run(_engine(demo_model_dir), tok, compiler, spec,
               SamplingParams(max_tokens=200, temperature=0.7, seed=1))
    done = [text for text, finish, _ in out if finish == "stop"]
    assert len(done) >= 3, out  # random weights may ramble in whitespace until max_tokens
    for text in done:
        jsonschema.validate(json.loads(text), SCHEMA)
        if whitespace == "compact":  # xgrammar's separators then: ", " and ": "
            assert text == json.dumps(json.loads(text), ensure_ascii=False), text
        if pattern:  # between tokens (strings masked out): nothing but single newlines
            assert re.fullmatch(r"[^ \t\r\n]*(\n[^ \t\r\n]+)*\n?[^ \t\r\n]*",
                                re.sub(r'"(?:\\.|[^"\\])*"', "S", text)), text


def test_json_whitespace_is_bounded_by_default():
    """Without a pattern, JSON's whitespace between tokens is llama.cpp's: a space, or one
    newline and up to 20 spaces or tabs; never a run of newlines (a small model's way to fill
    max_tokens)."""
    from xgrammar.testing import _is_grammar_accept_string as accepts

    from pipellm.shared.grammar import _grammar

    grammar = _grammar(GrammarSpec("json_object"))
    for text in ('{"a": [1, 2]}', '{\n  "a": [\n\t\t1\n  ]\n}', '{"a":1}'):
        assert accepts(grammar, text), text
    for text in ('{"a":\n\n1}', '{"a":' + " " * 2 + "1}", '{\n' + " " * 21 + '"a":1}'):
        assert not accepts(grammar, text), text


@pytest.mark.parametrize("pattern, accepted", [
    ("[ ]?", ['{"a": [1, 2], "b": "x y"}', '{"a":[1,2],"b":"x y"}']),
    ("(\n *)?", ['{\n  "a":[1],\n  "b":"x"}', '{"a":[],"b":""}']),
])
def test_a_whitespace_pattern_is_the_json_grammars_whitespace(compiler, pattern, accepted):
    """pipellm/shared/grammar_whitespace: exactly the pattern between tokens, strings untouched."""
    from xgrammar.testing import _is_grammar_accept_string as accepts

    from pipellm.shared.grammar import _grammar

    schema = {"type": "object", "properties": {"a": {"type": "array", "items": {
        "type": "integer"}}, "b": {"type": "string"}}, "required": ["a", "b"]}
    grammar = _grammar(GrammarSpec("json_schema", json.dumps(schema), whitespace_pattern=pattern))
    assert all(accepts(grammar, text) for text in accepted)
    for text in ('{"a":  [1], "b": ""}', '{"a":[1],\t"b":""}', '{ "a":[1]\n\n,"b":""}'):
        assert not accepts(grammar, text), text
    with pytest.raises(GrammarError) as e:
        compiler.compile(GrammarSpec("json_object", whitespace_pattern="(?<=a)", param="p"))
    assert e.value.param == "p" and "whitespace_pattern: Regex parsing error" in str(e.value)


def test_max_tokens_ends_with_length_and_a_valid_prefix(demo_model_dir, tok, compiler):
    out = _run(_engine(demo_model_dir), tok, compiler, GrammarSpec("regex", "[ab]{50}"),
               SamplingParams(max_tokens=5, temperature=1.0, seed=3))
    for text, finish, seq in out:
        assert finish == "length" and seq.num_output == 5 and set(text) <= {"a", "b"}


def test_grammar_end_wins_over_ignore_eos_and_min_tokens(demo_model_dir, tok, compiler):
    params = SamplingParams(max_tokens=40, temperature=1.0, seed=2, ignore_eos=True,
                            min_tokens=30)
    out = _run(_engine(demo_model_dir), tok, compiler, GrammarSpec("regex", "ok"), params)
    assert all(text == "ok" and finish == "stop" for text, finish, _ in out), out


def test_the_mask_is_obeyed_token_by_token(demo_model_dir, tok, compiler):
    """A planted grammar: at every step the sampled token is one the matcher allowed, and
    mask_logits leaves exactly those finite (rows without a grammar untouched)."""
    grammar = compiler.compile(GrammarSpec("regex", "[xyz]{4}"))
    state, vocab = GrammarState(grammar), compiler.info.vocab_size
    free = type("Seq", (), {"grammar": None})()
    logits = torch.randn(2, vocab)
    for _ in range(4):
        masked = mask_logits(logits.clone(), [type("Seq", (), {"grammar": state})(), free])
        allowed = torch.isfinite(masked[0]).nonzero().flatten().tolist()
        assert allowed and all(set(decode(tok, [t])) <= set("xyz") for t in allowed)
        assert torch.equal(masked[1], logits[1])
        state.accept(int(masked[0].argmax()))
    assert state.matcher.is_completed()


def test_logprobs_stay_the_models(demo_model_dir, tok, compiler):
    """The chosen tokens' logprobs are those of the unconstrained distribution: the same as
    the free run's where the grammar happened to pick the free run's (greedy) token."""
    engine = _engine(demo_model_dir)
    params = SamplingParams(max_tokens=8, temperature=0, logprobs=True)
    free = engine.generate([encode(tok, PROMPTS[0])], params)[0]
    first = decode(tok, free.output_ids[:1])
    out = _run(engine, tok, compiler, GrammarSpec("regex", re.escape(first) + "[a-z]*"), params,
               prompts=PROMPTS[:1])
    seq = out[0][2]
    assert seq.output_ids[0] == free.output_ids[0]
    assert seq.logprobs[0] == pytest.approx(free.logprobs[0], abs=1e-5)


def test_preemption_keeps_the_grammar(demo_model_dir, tok, compiler):
    """A KV cache too small for every request at once: sequences are preempted and recomputed,
    and their outputs still match (the matcher follows the kept output tokens)."""
    engine = _engine(demo_model_dir, kv_cache_tokens=96, default_predicted_len=4,
                     scheduler=SchedulerConfig(max_running=8, max_batched_tokens=32))
    pattern = r"[a-z]{10,30}\."
    out = _run(engine, tok, compiler, GrammarSpec("regex", pattern),
               SamplingParams(max_tokens=40, temperature=1.0, seed=5), prompts=PROMPTS * 2)
    assert engine.stats().preemptions > 0
    assert all(finish == "stop" and re.fullmatch(pattern, text) for text, finish, _ in out), out


def test_a_resumed_request_replays_its_tokens(demo_model_dir, tok, compiler):
    """After a crash compute gets a choice's tokens so far: the grammar goes on from there, and
    a seeded run ends exactly as the uninterrupted one."""
    spec, params = GrammarSpec("json_schema", json.dumps(SCHEMA)), \
        SamplingParams(max_tokens=60, temperature=0.8, seed=11)
    whole = _run(_engine(demo_model_dir), tok, compiler, spec, params)
    cut = [s.output_ids[:7] for _, _, s in whole]
    resumed = _run(_engine(demo_model_dir), tok, compiler, spec, params, output_ids=cut)
    assert [(t, f) for t, f, _ in resumed] == [(t, f) for t, f, _ in whole]


def test_choices_with_seeds_repeat(demo_model_dir, tok, compiler):
    spec = GrammarSpec("regex", "[a-f]{6}")
    params = [SamplingParams(max_tokens=10, temperature=1.0, seed=s) for s in (1, 2, 1)]
    engine = _engine(demo_model_dir)
    grammar = compiler.compile(spec)
    ids = encode(tok, PROMPTS[0])
    seqs = [engine.requests[engine.add_request(ids, p, grammar=grammar)] for p in params]
    while engine.has_work():
        engine.step()
    texts = [decode(tok, s.output_ids) for s in seqs]
    assert texts[0] == texts[2] and all(re.fullmatch("[a-f]{6}", t) for t in texts)


BAD = [GrammarSpec("regex", "(open", param="structured_outputs.regex"),
       GrammarSpec("json_schema", '{"type": "nope"}'), GrammarSpec("grammar", "root ::= missing"),
       GrammarSpec("grammar", "start: UNDEFINED", param="guided_grammar")]


def test_compiler_caches_and_reports_errors(compiler):
    spec = GrammarSpec("json_schema", json.dumps(SCHEMA))
    assert compiler.compile(spec) is compiler.compile(spec) is compiler.cached(spec)
    assert GrammarSpec("json_schema", json.dumps(SCHEMA), param="other").key == spec.key
    for bad in BAD:
        with pytest.raises(GrammarError) as e:
            compiler.compile(bad)
        assert e.value.param == bad.param and str(e.value).startswith(bad.param)
        assert "/project/" not in str(e.value) and ".cc:" not in str(e.value)


def test_the_queue_compiles_off_the_loop(demo_model_dir):
    """compute's GrammarQueue: each item comes back with its grammar or its error, in order."""
    import time

    from pipellm.services.compute.structured import GrammarQueue

    queue = GrammarQueue(str(demo_model_dir))
    specs = [GrammarSpec("regex", "[a-c]{3}"), BAD[0], GrammarSpec("regex", "[a-c]{3}")]
    for i, spec in enumerate(specs):
        queue.submit(spec, i)
    done, deadline = [], time.monotonic() + 60
    while len(done) < 3 and time.monotonic() < deadline:
        done += queue.ready()
        time.sleep(0.01)
    assert [i for i, _ in done] == [0, 1, 2] and not queue.waiting
    assert isinstance(done[1][1], GrammarError) and done[0][1] is done[2][1]


def test_json_grammars_never_allow_control_characters(compiler):
    """xgrammar's JSON strings would take a raw control character (json.loads rejects it):
    the JSON kinds' allowed row clears every token holding one but newline."""
    loaded = compiler.compile(GrammarSpec("json_object"))
    words = loaded.allowed.tolist()
    for token, raw in enumerate(compiler.info.decoded_vocab):
        bit = (words[token // 32] >> (token % 32)) & 1
        assert bit == (not any(c < 0x20 and c != 0x0A for c in raw)), (token, raw)
    assert compiler.compile(GrammarSpec("regex", "a")).allowed is None


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=80, temperature=0),
                                    SamplingParams(max_tokens=80, temperature=0.7, seed=3)],
                         ids=["greedy", "seeded"])
def test_speculation_keeps_the_grammar_and_the_tokens(demo_model_dir, tok, compiler, params):
    """n-gram drafts are cut to what the grammar accepts, and each verify row is masked as
    after the drafts before it: the outputs are those without speculation, and drafts of the
    JSON the prompts hold are accepted."""
    spec = GrammarSpec("json_schema", json.dumps(SCHEMA), "compact")
    record = '{"name": "ab", "n": 12, "tags": ["x", "y"]}'
    prompts = [f"{record} {record} {p}" for p in PROMPTS]
    want = _run(_engine(demo_model_dir), tok, compiler, spec, params, prompts=prompts)
    ngram = json.dumps({"method": "ngram", "num_speculative_tokens": 4,
                        "prompt_lookup_min": 1, "disable_by_batch_size": 8})
    engine = _engine(demo_model_dir, scheduler=SchedulerConfig(speculative_config=ngram))
    got = _run(engine, tok, compiler, spec, params, prompts=prompts)
    assert [(t, f) for t, f, _ in got] == [(t, f) for t, f, _ in want]
    stats = engine.stats()
    assert 0 < stats.spec_accepted_tokens <= stats.spec_draft_tokens, stats


def test_the_grammar_starts_once_the_reasoning_has_ended(demo_model_dir, tok, compiler):
    """A reasoning model's grammar (compute/structured.ReasoningGate): free tokens until the
    end marker (forced here by a thinking budget of 6: the demo model never writes it), then
    the regex; the split answer's content matches it whole, the reasoning need not."""
    from pipellm.shared.reasoning import parser, split

    end = tuple(encode(tok, "</think>", add_special_tokens=False))
    params = SamplingParams(max_tokens=60, temperature=1.0, seed=11, thinking_budget=6,
                            thinking_end_ids=end)
    pattern = r"[0-9]{3}-[a-z]{2,4}"
    out = _run(_engine(demo_model_dir), tok, compiler, GrammarSpec("regex", pattern), params)
    free = 0
    for text, finish, seq in out:
        assert tuple(seq.output_ids[6 : 6 + len(end)]) == end, text
        reasoning, content = split(parser("deepseek_r1"), text)
        assert finish == "stop" and re.fullmatch(pattern, content), (text, finish)
        free += not re.fullmatch(r"[0-9a-z-]*", reasoning)
    assert free  # the reasoning was not held to the grammar


def test_a_gate_with_an_opening_lets_the_grammar_take_an_output_that_never_opens():
    from pipellm.services.compute.structured import ReasoningGate

    gate = ReasoningGate(start=(5, 6), end=(8,))
    assert gate.feed(5) == [] and gate.opening == 1
    assert gate.feed(7) == [5, 7] and gate.passed  # not the opening: the grammar takes both
    gate = ReasoningGate(start=(5,), end=(8, 9))
    assert [gate.feed(t) for t in (5, 1, 8, 9)] == [[], [], [], []] and gate.passed
    assert gate.feed(3) == [3]
    starts_inside = ReasoningGate(start=(), end=(8,))
    assert starts_inside.feed(1) == [] and not starts_inside.passed


def test_under_qwen3_an_output_that_never_opens_is_all_grammar(demo_model_dir, tok, compiler):
    """qwen3's rule (thinking_start_ids set): the first token may open <think> or start the
    grammar's answer; the demo model does not open it, so the whole output is the regex's."""
    start = tuple(encode(tok, "<think>", add_special_tokens=False))[:1]  # one token, as Qwen3's
    end = tuple(encode(tok, "</think>", add_special_tokens=False))
    params = SamplingParams(max_tokens=40, temperature=1.0, seed=5, thinking_end_ids=end,
                            thinking_start_ids=start)
    pattern = r"(yes|no), (red|blue)!"
    out = _run(_engine(demo_model_dir), tok, compiler, GrammarSpec("regex", pattern), params)
    for text, finish, seq in out:
        assert seq.grammar.gate.passed and finish == "stop" and re.fullmatch(pattern, text)
