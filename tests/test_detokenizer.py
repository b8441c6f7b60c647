"""Detokenizer core: incremental decoding never splits a character; stop strings never leak."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from pipellm.services.detokenizer.incremental import IncrementalDetokenizer
from pipellm.services.detokenizer.stop import StopMatcher
from pipellm.shared.demo_model import _CORPUS, build_demo_tokenizer

FFFD = "\ufffd"
TEXTS = [
    "你好，世界！今天天气很好。",
    "👍🏽 👨‍👩‍👧 🇯🇵",
    "Hello 世界, the café ñ e\u0301 \u0915\u094d\u0937 done.",
    "  two  spaces\tand\nnewlines 😀😀",
]
CHARS = st.characters(codec="utf-8", exclude_characters=FFFD)  # any scalar value but U+FFFD


def _sentencepiece_like(metaspace_decoder: bool) -> Tokenizer:
    """A Llama-2-style BPE: Metaspace pre-tokenizer, <0xXX> byte-fallback tokens."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first", split=False)
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"])
    tok.train_from_iterator([_CORPUS], trainer)
    spec = json.loads(tok.to_str())  # add the 256 <0xXX> byte tokens, turn byte_fallback on
    vocab, spec["model"]["byte_fallback"] = spec["model"]["vocab"], True
    vocab.update({f"<0x{b:02X}>": len(vocab) + b for b in range(256)})
    tok = Tokenizer.from_str(json.dumps(spec))
    if metaspace_decoder:
        tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace()])
    else:  # the exact decoder of Llama-2's tokenizer.json
        tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                         decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    return tok


TOKENIZERS = {"byte_bpe": build_demo_tokenizer(), "sp_strip": _sentencepiece_like(False),
              "sp_metaspace": _sentencepiece_like(True)}
tokenizer_names = pytest.mark.parametrize("name", list(TOKENIZERS))


def _stream(detok: IncrementalDetokenizer, ids: list[int], sizes: list[int]) -> list[str]:
    """Feed ids in chunks of `sizes` (cycled), then flush; return all deltas, flush last."""
    deltas, i = [], 0
    while i < len(ids):
        n = sizes[len(deltas) % len(sizes)] if sizes else 1
        deltas.append(detok.add(ids[i : i + n]))
        i += n
    deltas.append(detok.flush())
    assert detok.text == "".join(deltas)
    return deltas


def _check(tok: Tokenizer, ids: list[int], sizes: list[int], skip: bool = True) -> list[str]:
    """Stream `ids` (no prompt); the deltas must add up to the whole-sequence decode."""
    deltas = _stream(IncrementalDetokenizer(tok, skip_special_tokens=skip), ids, sizes)
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip)
    return deltas


@tokenizer_names
@pytest.mark.parametrize("text", TEXTS)
def test_token_by_token_matches_full_decode(name: str, text: str) -> None:
    tok = TOKENIZERS[name]
    deltas = _check(tok, tok.encode(text, add_special_tokens=False).ids, [1])
    assert not any(FFFD in d for d in deltas)
    assert sum(d == "" for d in deltas[:-1]) > 0  # something really was held back
    ids = tok.encode("你", add_special_tokens=False).ids[-3:]  # E4 BD A0, one id per byte
    detok = IncrementalDetokenizer(tok)
    assert [detok.add([i]) for i in ids] == ["", "", "你"] and detok.flush() == ""


@tokenizer_names
def test_chunks_ending_mid_character_emit_completed_characters(name: str) -> None:
    tok = TOKENIZERS[name]
    ids = tok.encode("é" * 80 + "!", add_special_tokens=False).ids  # "é": 2 byte ids (+ "▁")
    off = len(ids) - 160  # up to the middle of the first "é"
    detok = IncrementalDetokenizer(tok)
    assert detok.add(ids[:off]) == ""
    # Every chunk ends mid-character yet completes the previous one: nothing is held back.
    assert [detok.add(ids[i : i + 2]) for i in range(off, len(ids), 2)] == ["é"] * 79 + ["é!"]
    assert detok.flush() == "" and detok.text == tok.decode(ids)


@tokenizer_names
@settings(max_examples=80, deadline=None)
@given(prompt=st.none() | st.text(CHARS, max_size=30), text=st.text(CHARS),
       sizes=st.lists(st.integers(1, 6), max_size=8))
def test_random_text_random_chunks(name, prompt, text, sizes) -> None:
    """No prompt: deltas == decode(output). Prompt: they continue decode(prompt) exactly."""
    tok = TOKENIZERS[name]
    p_ids = [] if prompt is None else tok.encode(prompt).ids  # with BOS for byte_bpe
    o_ids = tok.encode(text, add_special_tokens=False).ids
    whole, head = tok.decode(p_ids + o_ids), tok.decode(p_ids)
    assert whole.startswith(head) and (p_ids or whole == tok.decode(o_ids))
    deltas = _stream(IncrementalDetokenizer(tok, p_ids), o_ids, sizes)
    assert "".join(deltas) == whole[len(head) :]
    assert not any(FFFD in d for d in deltas[:-1])


@tokenizer_names
@pytest.mark.parametrize("text", TEXTS)
def test_prompt_split_at_every_character_boundary(name: str, text: str) -> None:
    tok = TOKENIZERS[name]
    ids = tok.encode(text, add_special_tokens=False).ids
    whole = tok.decode(ids)
    for k in range(len(ids)):
        head = tok.decode(ids[:k])
        if FFFD in head:
            continue  # the prompt must end on a character boundary
        for prompt in ids[:k], ids[max(0, k - 6) : k]:  # whole prompt; a tail (maybe mid-char)
            deltas = _stream(IncrementalDetokenizer(tok, prompt), ids[k:], [1])
            assert "".join(deltas) == whole[len(head) :], (k, len(prompt))
            assert not any(FFFD in d for d in deltas)


@settings(max_examples=60, deadline=None)
@given(ids=st.lists(st.integers(0, 999), max_size=60), sizes=st.lists(st.integers(1, 5)),
       skip=st.booleans())
def test_random_ids_including_invalid_utf8_and_specials(ids, sizes, skip) -> None:
    _check(TOKENIZERS["byte_bpe"], ids, sizes, skip)


@tokenizer_names
def test_special_tokens_skipped_or_kept(name: str) -> None:
    tok = TOKENIZERS[name]
    bos, eos = tok.token_to_id("<s>"), tok.token_to_id("</s>")
    text_ids = tok.encode(" a 你好", add_special_tokens=False).ids
    ids = [bos, *text_ids[:2], eos, bos, *text_ids[2:], eos]
    assert "<s>" not in "".join(_check(tok, ids, [1]))
    assert "".join(_check(tok, ids, [1], skip=False)).count("<s>") == 2


@pytest.mark.parametrize("name", ["sp_strip", "sp_metaspace"])
def test_leading_space_after_prompt_and_after_runs_of_skipped_specials(name: str) -> None:
    tok = TOKENIZERS[name]
    eos, word = tok.token_to_id("</s>"), tok.encode("world").ids  # "▁w", ...
    assert IncrementalDetokenizer(tok).add(word) == "world"
    assert IncrementalDetokenizer(tok, tok.encode("Hello").ids).add(word) == " world"
    prompt = tok.encode("Hello").ids + [eos] * 6  # the last 5 prompt ids decode to nothing
    assert IncrementalDetokenizer(tok, prompt).add(word) == " world"
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.add(tok.encode("Hi").ids), *(detok.add([eos]) for _ in range(40))]
    assert "".join(deltas) + detok.add(word) == "Hi world" == tok.decode(tok.encode("Hi world").ids)


def test_invalid_bytes_do_not_grow_the_window_forever() -> None:
    tok = TOKENIZERS["byte_bpe"]
    lead = tok.encode("你", add_special_tokens=False).ids[0]  # 0xE4: never completed here
    deltas = _check(tok, [lead] * 100, [1])
    assert "".join(deltas[:-1]).count(FFFD) >= 60  # emitted before the end of the request


def test_decode_windows_stay_small() -> None:
    real, lengths = TOKENIZERS["byte_bpe"], []
    spy = SimpleNamespace(  # records the length of every window the detokenizer decodes
        get_added_tokens_decoder=real.get_added_tokens_decoder,
        decode=lambda ids, **kw: lengths.append(len(ids)) or real.decode(ids, **kw))
    ids = real.encode("".join(TEXTS) * 20, add_special_tokens=False).ids
    assert len(ids) > 1000
    assert "".join(_stream(IncrementalDetokenizer(spy), ids, [1])) == real.decode(ids)
    assert len(lengths) >= len(ids) and max(lengths) <= 8


def _run_stops(stops, text, sizes, include=False) -> tuple[list, StopMatcher]:
    """Feed `text` in chunks of `sizes` (cycled); return [(chunk, (out, matched))] and matcher."""
    m, outs, i = StopMatcher(stops, include), [], 0
    while i < len(text):
        n = sizes[len(outs) % len(sizes)] if sizes else 1
        outs.append((text[i : i + n], m.feed(text[i : i + n])))
        i += n
    return outs, m


def test_stop_split_at_beginning_never_matched_include_and_none() -> None:
    m = StopMatcher(["STOP"])  # split across feeds; nothing after the match
    assert [m.feed(t) for t in ["abcST", "O", "Pxyz", "more"]] == [
        ("abc", False), ("", False), ("", True), ("", True)]
    assert m.flush() == "" and m.matched
    assert StopMatcher(["STOP"]).feed("STOP here") == ("", True)
    m = StopMatcher(["STOP"])
    assert (m.feed("abc S"), m.feed("T"), m.flush(), m.matched) == (
        ("abc ", False), ("", False), "ST", False)
    assert StopMatcher(["ST", "OP"], True).feed("aSTOP") == ("aST", True)
    assert StopMatcher([]).feed("S") == ("S", False)
    with pytest.raises(ValueError):
        StopMatcher(["ok", ""])
    with pytest.raises(TypeError):
        StopMatcher("STOP")


def test_overlapping_stops_earliest_start_then_shortest() -> None:
    outs, m = _run_stops(["c", "bcd"], "abcdz", [1])  # "bcd" starts before "c"
    assert [o for _, o in outs] == [("a", False), ("", False), ("", False), ("", True), ("", True)]
    outs, m = _run_stops(["c", "bcd"], "abcx", [1])  # "bcd" fails: "c" settles
    assert "".join(o for _, (o, _) in outs) == "ab" and m.matched
    outs, m = _run_stops(["c", "bcd"], "abc", [1])  # end of stream settles the pending "c"
    assert m.flush() == "b" and m.matched
    assert StopMatcher(["abc", "ab"], True).feed("xabcd") == ("xab", True)


@settings(max_examples=300, deadline=None)
@given(text=st.text("abc", max_size=30), stops=st.lists(st.text("abc", min_size=1, max_size=4),
       max_size=3), sizes=st.lists(st.integers(1, 5), max_size=6), include=st.booleans())
def test_stop_property_matches_reference(text, stops, sizes, include) -> None:
    found = [(i, len(s)) for s in stops if (i := text.find(s)) >= 0]
    start, length = min(found, default=(len(text), 0))
    expected = text[: start + length if include else start]
    outs, m = _run_stops(stops, text, sizes, include)
    emitted, fed = "", ""
    for chunk, (out, matched) in outs:
        fed, emitted = fed + chunk, emitted + out
        assert fed.startswith(emitted)
        if not matched:  # held back: only a proper prefix of some stop, nothing more
            held = fed[len(emitted) :]
            assert not any(s in emitted for s in stops)
            assert held == "" or any(len(s) > len(held) and s.startswith(held) for s in stops)
        elif not include:
            assert not any(s in emitted for s in stops)
    emitted += m.flush()
    assert emitted == expected and m.matched == bool(found)


def test_detokenizer_into_stop_matcher_cjk() -> None:
    tok = TOKENIZERS["byte_bpe"]
    ids = tok.encode("你好，世界！今天天气很好。明天见", add_special_tokens=False).ids
    for include, expected in [(False, "你好，世界！今天"), (True, "你好，世界！今天天气")]:
        detok, stop, shown = IncrementalDetokenizer(tok), StopMatcher(["天气"], include), ""
        for i in ids:
            out, matched = stop.feed(detok.add([i]))
            assert FFFD not in out and "天气" not in shown
            shown += out
            if matched:
                break
        assert shown == expected and stop.matched


def test_prompt_logprob_pieces_join_onto_the_first_delta() -> None:
    """Chunked prefill scores the prompt in pieces over several steps: they reach the gateway
    joined, with the prompt's ids, on the request's first delta; top-k rows ride each token."""
    from array import array

    from pipellm.services.detokenizer.service import Detokenizer
    from pipellm.shared.messages import Route, StepOutput, Tokens

    def piece(start, ids):
        n = len(ids)
        return Tokens("r:0", start, array("i", ids), array("f", [-1.0] * n),
                      array("i", range(2 * n)), array("f", [-0.5] * (2 * n)))

    detok = Detokenizer(TOKENIZERS["byte_bpe"], ttl_s=60)
    route = Route("r:0", "gw", num_prompt=5, prompt_tail=array("i", [1, 2, 3, 4, 5]),
                  prompt_ids=array("i", [1, 2, 3, 4, 5]), scores_prompt=True)
    assert not detok.handle(StepOutput([route], prompt=[piece(1, [2, 3])])).deltas
    top = Tokens("r:0", 5, array("i", [9]), array("f", [-0.1]), array("i", [9, 8]),
                 array("f", [-0.125, -3.0]))
    res = detok.handle(StepOutput([], [top], prompt=[piece(3, [4, 5])]))
    (first,) = res.deltas["gw"]
    assert list(first.prompt_ids) == [1, 2, 3, 4, 5]
    p = first.prompt
    assert (p.start, list(p.token_ids), p.k, len(p.top_ids)) == (1, [2, 3, 4, 5], 2, 8)
    assert first.tokens is top  # the record compute sent, passed on as it is
    last = Tokens("r:0", 6, array("i", [7]), array("f", [-0.2]), finish_reason="length")
    (second,) = detok.handle(StepOutput([], [last])).deltas["gw"]
    assert second.prompt_ids is None and second.prompt is None
    assert second.finish_reason == "length" and len(second.tokens.top_ids) == 0


def test_a_stop_string_in_a_finished_record_ends_it_with_stop() -> None:
    """A beam search's hypothesis arrives whole with compute's finish reason: a stop string
    in it cuts the text there and the choice ends with "stop" (no abort: it is over)."""
    from array import array

    from pipellm.services.detokenizer.service import Detokenizer
    from pipellm.shared.messages import Route, StepOutput, Tokens

    tok = TOKENIZERS["byte_bpe"]
    ids = tok.encode("one two. three").ids
    detok = Detokenizer(tok, ttl_s=60)
    route = Route("r:1", "gw", num_prompt=1, prompt_tail=array("i", [ids[0]]), stop=["."])
    record = Tokens("r:1", 1, array("i", ids), array("f", [-1.0] * len(ids)),
                    finish_reason="length")
    res = detok.handle(StepOutput([route], [record]))
    (delta,) = res.deltas["gw"]
    assert (delta.text, delta.finish_reason, res.stops) == ("one two", "stop", [])
