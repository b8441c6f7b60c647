"""Grammars that constrain a request's output (structured outputs), compiled with xgrammar.

A request's constraint travels as a `GrammarSpec` (what the client asked for: a JSON schema,
any JSON object, a regex, a choice of strings, an EBNF or Lark grammar) from the gateway to a
tokenizer, which compiles it against the model's vocabulary (`GrammarCompiler`, cached by the
spec) and sends it on to compute serialized (`CompiledSpec`), so compute's loop never compiles:
it deserializes a grammar the first time it sees it (`GrammarCompiler.load`, cached by key).

xgrammar is the grammar engine vLLM, SGLang and TensorRT-LLM use by default; it is imported only
where a grammar is compiled or matched (tokenizer and compute), never by the gateway.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from shared.codec import message

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
_JSON_KINDS = ("json_schema", "json_object")
_WHERE = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")


class GrammarError(ValueError):
    """A spec that cannot be compiled; `param` names the request field (a 400)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


@message
class GrammarSpec:
    """One request's output constraint as the client gave it. kind: one of KINDS; spec: the
    JSON schema (JSON text), the regex, the choices (a JSON list of strings) or the grammar
    (EBNF with `::=` rules, else Lark); unused for json_object. whitespace: the JSON kinds'
    whitespace between tokens ("any", or "compact": none). param: the request field it came
    from (named in errors)."""

    kind: str
    spec: str = ""
    whitespace: str = "any"
    param: str = "response_format"

    @property
    def key(self) -> str:
        """Same constraint, same key (the caches' key; param is not part of it)."""
        text = json.dumps([self.kind, self.spec, self.whitespace])
        return hashlib.sha256(text.encode()).hexdigest()[:32]


@message
class CompiledSpec:
    """A grammar compiled against the served model's vocabulary: xgrammar's serialized form;
    or, from a tokenizer without xgrammar (the slim image has no torch, which xgrammar needs),
    the spec itself, which compute then compiles (once per key). json: a JSON kind."""

    key: str
    serialized: str = ""
    spec: GrammarSpec | None = None
    json: bool = False


@dataclass(frozen=True)
class LoadedGrammar:
    """A grammar ready for matchers (compute): xgrammar's CompiledGrammar and, for JSON, the
    tokens allowed besides its rules (int32 bitmask row [ceil(vocab / 32)]): none with a
    control character but newline, which JSON never allows unescaped and xgrammar's JSON
    strings would (json.loads rejects them); None: no such filter."""

    compiled: Any
    allowed: Any = None


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
    `get()` waits for it; raises ImportError where xgrammar cannot be imported (no torch)."""

    def __init__(self, model: str):
        from concurrent.futures import ThreadPoolExecutor

        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-compiler")
        self._future = self._pool.submit(model_compiler, model)
        self._pool.shutdown(wait=False)

    def get(self) -> GrammarCompiler:
        return self._future.result()


def model_compiler(model: str) -> GrammarCompiler:
    """The compiler for the model at `model` (its tokenizer, logits width and EOS ids: the
    same on the tokenizer's side and compute's)."""
    from shared.model_config import ModelConfig
    from shared.tokenizer import load_tokenizer

    cfg = ModelConfig.from_path(model)
    return GrammarCompiler(load_tokenizer(model), cfg.vocab_size, cfg.eos_token_ids)


class GrammarCompiler:
    """Compiles specs for one model (tokenizer side) and loads compiled ones (compute side),
    each behind an LRU cache of `cache_size` grammars."""

    def __init__(self, tokenizer, vocab_size: int, stop_ids: tuple[int, ...],
                 cache_size: int = 256):
        import xgrammar as xgr

        self.info = _tokenizer_info(tokenizer, vocab_size, stop_ids)
        self._compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        self._compiled = _Lru(cache_size, OrderedDict())  # key -> CompiledSpec
        self._loaded = _Lru(cache_size, OrderedDict())  # key -> LoadedGrammar
        self._json_allowed = None  # int32 bitmask row, made at the first JSON grammar

    def compile(self, spec: GrammarSpec) -> CompiledSpec:
        """The spec compiled and serialized; raises GrammarError naming spec.param."""
        key = spec.key
        if (hit := self._compiled.get(key)) is not None:
            return hit
        compiled = self._compile(spec)
        out = CompiledSpec(key, compiled.serialize_json(), json=spec.kind in _JSON_KINDS)
        self._compiled.put(key, out)
        self._loaded.put(key, self._ready(compiled, out.json))
        return out

    def _compile(self, spec: GrammarSpec):
        c = self._compiler
        compact = spec.whitespace == "compact"
        try:
            if spec.kind == "json_schema":
                return c.compile_json_schema(spec.spec, any_whitespace=not compact,
                                             strict_mode=True)
            if spec.kind == "json_object":
                return c.compile_json_schema('{"type": "object"}', any_whitespace=not compact)
            if spec.kind == "regex":
                return c.compile_regex(spec.spec)
            if spec.kind == "choice":
                return c.compile_grammar(_choice_grammar(json.loads(spec.spec)))
            if spec.kind == "grammar":
                if "::=" in spec.spec:
                    return c.compile_grammar(spec.spec)
                return c.compile_lark(spec.spec)
        except Exception as e:  # xgrammar raises RuntimeError/ValueError with its reason
            lines = str(e).strip().splitlines() or [type(e).__name__]
            reason = _WHERE.sub("", lines[0])  # xgrammar's "[time] file.cc:line: " prefix
            raise GrammarError(spec.param, f"{spec.param}: cannot compile the {spec.kind}: "
                               f"{reason}"[:500]) from None
        raise GrammarError(spec.param, f"unknown grammar kind {spec.kind!r}")

    def load(self, compiled: CompiledSpec) -> LoadedGrammar:
        """The grammar of a serialized one (deserialized once per key), or of a spec sent
        uncompiled (compiled here; GrammarError when it does not compile)."""
        import xgrammar as xgr

        if (hit := self._loaded.get(compiled.key)) is not None:
            return hit
        if not compiled.serialized:
            self.compile(compiled.spec)
            return self._loaded.get(compiled.key)
        grammar = xgr.CompiledGrammar.deserialize_json(compiled.serialized, self.info)
        loaded = self._ready(grammar, compiled.json)
        self._loaded.put(compiled.key, loaded)
        return loaded

    def _ready(self, compiled, json_kind: bool) -> LoadedGrammar:
        if not json_kind:
            return LoadedGrammar(compiled)
        if self._json_allowed is None:
            self._json_allowed = _allowed_row(self.info, lambda b: not any(
                c < 0x20 and c != 0x0A for c in b))
        return LoadedGrammar(compiled, self._json_allowed)
