"""Grammars that constrain a request's output (structured outputs), with xgrammar.

A request's constraint travels as a `GrammarSpec` (what the client asked for: a JSON schema,
any JSON object, a regex, a choice of strings, an EBNF or Lark grammar) from the gateway through
a tokenizer to compute, which compiles it against the model's vocabulary in a thread off its
loop (`GrammarCompiler.compile`, cached by the spec; xgrammar releases the GIL). A spec that
does not compile is a GrammarError naming the request's field: the client's 400.

xgrammar is the grammar engine vLLM, SGLang and TensorRT-LLM use by default; only compute
imports it (and transformers with it, ~2 s after torch), before it reports ready.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from pipellm.shared.codec import message
from pipellm.shared.grammar_whitespace import json_with_whitespace

_JSON_KINDS = ("json_schema", "json_object")
_WHERE = re.compile(r"\[[0-9:]+\] \S+:\d+: ")


class GrammarError(ValueError):
    """A spec that cannot be compiled; `param` names the request field (a 400)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


# JSON's whitespace between tokens unless a request gives a pattern: none, a space, or one
# newline and up to 20 spaces or tabs (llama.cpp's JSON grammars' `space` rule). Any run of
# whitespace, xgrammar's default, lets a small model fill max_tokens with it.
BOUNDED_WHITESPACE = r"( |\n[ \t]{0,20})?"


@message
class GrammarSpec:
    """One request's output constraint as the client gave it. kind: json_schema, json_object,
    regex, choice or grammar; spec: the JSON schema (JSON text), the regex, the choices (a JSON
    list of strings) or the grammar (EBNF with `::=` rules, else Lark); unused for json_object.
    whitespace: the JSON kinds' whitespace between tokens ("any": BOUNDED_WHITESPACE, or
    "compact": only xgrammar's ", " and ": "); whitespace_pattern: else a regex it must match
    (JSON kinds; None: no pattern). param: the request field it came from (named in errors)."""

    kind: str
    spec: str = ""
    whitespace: str = "any"
    param: str = "response_format"
    whitespace_pattern: str | None = None

    @property
    def key(self) -> str:
        """Same constraint, same key (the caches' key; param is not part of it)."""
        text = json.dumps([self.kind, self.spec, self.whitespace, self.whitespace_pattern])
        return hashlib.sha256(text.encode()).hexdigest()[:32]


@dataclass(frozen=True)
class LoadedGrammar:
    """A grammar ready for matchers (compute): xgrammar's CompiledGrammar and, for JSON, the
    tokens allowed besides its rules (int32 bitmask row [ceil(vocab / 32)]): none with a
    control character but newline, which JSON never allows unescaped and xgrammar's JSON
    strings would (json.loads rejects them); None: no such filter."""

    compiled: Any
    allowed: Any = None


def _error(spec: GrammarSpec, exc: Exception) -> GrammarError:
    lines = str(exc).strip().splitlines() or [type(exc).__name__]
    reason = _WHERE.sub("", lines[0])  # xgrammar's "[time] file.cc:line: " prefix
    return GrammarError(spec.param, f"{spec.param}: cannot compile the {spec.kind}: "
                        f"{reason}"[:500])


def _grammar(spec: GrammarSpec):
    """The spec as an xgrammar Grammar (parsed, not yet compiled for a vocabulary)."""
    import xgrammar as xgr

    if spec.kind in _JSON_KINDS:
        schema = spec.spec if spec.kind == "json_schema" else '{"type": "object"}'
        grammar = xgr.Grammar.from_json_schema(schema, any_whitespace=spec.whitespace == "any",
                                               strict_mode=True)
        if spec.whitespace == "any":
            pattern = spec.whitespace_pattern
            return json_with_whitespace(grammar, BOUNDED_WHITESPACE if pattern is None else pattern)
        return grammar
    if spec.kind == "regex":
        return xgr.Grammar.from_regex(spec.spec)
    if spec.kind == "choice":
        return xgr.Grammar.from_ebnf(_choice_grammar(json.loads(spec.spec)))
    if spec.kind == "grammar":
        return (xgr.Grammar.from_ebnf(spec.spec) if "::=" in spec.spec
                else xgr.Grammar.from_lark(spec.spec))
    raise ValueError(f"unknown grammar kind {spec.kind!r}")


def _allowed_row(info, ok) -> Any:
    """int32 bitmask row [ceil(vocab / 32)]: bit t set where ok(token t's bytes)."""
    import torch

    bits = torch.zeros(info.vocab_size, dtype=torch.bool)
    bits[: len(info.decoded_vocab)] = torch.tensor([ok(b) for b in info.decoded_vocab])
    padded = torch.zeros((info.vocab_size + 31) // 32 * 32, dtype=torch.int64)
    padded[: info.vocab_size] = bits
    words = (padded.view(-1, 32) << torch.arange(32)).sum(-1)  # bit j of word w: token 32w + j
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _choice_grammar(choices: list[str]) -> str:
    """EBNF: exactly one of the strings (JSON string literals are EBNF's)."""
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


def _tokenizer_info(tokenizer, vocab_size: int, stop_ids: tuple[int, ...]):
    """xgrammar's view of the vocabulary: our `tokenizers.Tokenizer` as a transformers fast
    tokenizer (from which xgrammar reads how tokens encode bytes), padded to the logits'
    width, ending on the model's EOS ids."""
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer)
    return xgr.TokenizerInfo.from_huggingface(fast, vocab_size=vocab_size,
                                              stop_token_ids=list(stop_ids))


@dataclass
class _Lru:
    limit: int
    items: OrderedDict

    def get(self, key):
        if key in self.items:
            self.items.move_to_end(key)
            return self.items[key]
        return None

    def put(self, key, value) -> None:
        self.items[key] = value
        while len(self.items) > self.limit:
            self.items.popitem(last=False)


class BackgroundCompiler:
    """The model's GrammarCompiler, built in a thread from start-up on (loading the tokenizer,
    transformers and xgrammar takes ~2 s: no request should wait for that in a service's loop).
    `get()` waits for it; raises ImportError where xgrammar cannot be imported (no torch), or
    why it could not be built."""

    def __init__(self, model: str):
        from concurrent.futures import ThreadPoolExecutor

        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-compiler")
        self._future = self._pool.submit(model_compiler, model)
        self._pool.shutdown(wait=False)

    def get(self) -> GrammarCompiler:
        return self._future.result()

    def wait(self) -> None:
        """Until it is built or failed (get() then raises why)."""
        self._future.exception()


def model_compiler(model: str) -> GrammarCompiler:
    """The compiler for the model at `model` (its tokenizer, logits width and EOS ids: the
    same on the tokenizer's side and compute's)."""
    from pipellm.shared.model_config import ModelConfig
    from pipellm.shared.tokenizer import load_tokenizer

    cfg = ModelConfig.from_path(model)
    return GrammarCompiler(load_tokenizer(model), cfg.vocab_size, cfg.eos_token_ids)


class GrammarCompiler:
    """Compiles specs for one model (compute), behind an LRU cache of `cache_size` grammars."""

    def __init__(self, tokenizer, vocab_size: int, stop_ids: tuple[int, ...],
                 cache_size: int = 256):
        import xgrammar as xgr

        self.info = _tokenizer_info(tokenizer, vocab_size, stop_ids)
        self._compiler = xgr.GrammarCompiler(self.info, max_threads=2, cache_enabled=False)
        self._loaded = _Lru(cache_size, OrderedDict())  # key -> LoadedGrammar
        self._json_allowed = _allowed_row(self.info, lambda b: not any(
            c < 0x20 and c != 0x0A for c in b))  # int32 bitmask row for the JSON kinds

    def cached(self, spec: GrammarSpec) -> LoadedGrammar | None:
        return self._loaded.get(spec.key)

    def compile(self, spec: GrammarSpec) -> LoadedGrammar:
        """The spec compiled for the model (cached by key); raises GrammarError naming
        spec.param. Thread-safe enough for one compiling thread beside the loop's reads."""
        key = spec.key
        if (hit := self._loaded.get(key)) is not None:
            return hit
        try:
            compiled = self._compiler.compile_grammar(_grammar(spec))
        except Exception as e:
            raise _error(spec, e) from None
        loaded = self._ready(compiled, spec.kind in _JSON_KINDS)
        self._loaded.put(key, loaded)
        return loaded

    def _ready(self, compiled, json_kind: bool) -> LoadedGrammar:
        return LoadedGrammar(compiled, self._json_allowed if json_kind else None)
