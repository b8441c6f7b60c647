"""Parse and validate OpenAI `/v1/completions` and `/v1/chat/completions` bodies.

`parse_completion` / `parse_chat` turn a decoded JSON body into a `GenerationRequest` or raise
`APIError` (400 unless noted) naming the offending `param`. Rules:

* JSON null means "absent" for every optional field.
* Unknown keys are ignored and listed in `GenerationRequest.ignored` (the gateway logs them, as
  vLLM does); with `strict` they are a 400 "Unrecognized request argument supplied: X". Known
  OpenAI fields we do not implement -> "`X` is not supported", unless given a harmless value
  (null, false, {}, "none", ...). So are the extras routers add to what they forward
  (no_stop_trim, skip_special_tokens, ..., `_ROUTER_NEUTRAL`), with the values they add.
* Supported vLLM extras: top_k, min_p, repetition_penalty, min_tokens, ignore_eos,
  stop_token_ids, and for chat add_generation_prompt. logit_bias: {"<token id>": bias in
  [-100, 100]}. Completions' best_of >= n: best_of choices generated, the n with the highest
  cumulative logprob answered (not streamable). Chat messages: chat_messages.py. Structured
  outputs (response_format, structured_outputs, guided_*): structured.py.
* Sampling fields a request leaves unset (temperature, top_p, top_k, min_p, repetition_penalty,
  max_tokens) take the model's defaults (`GenerationDefaults`, resolved at start-up from
  --generation-config), else the API's.
* max_tokens: the given value, else the model's default, else 16 for completions (OpenAI's and
  vLLM's default) and for chat None (up to the context); a server-wide cap
  (`GenerationDefaults.max_tokens_limit`) lowers any of them. The tokenizer fits it to the
  context once the prompt is tokenized (`SamplingParams.fit_context`): a chat default is
  lowered to the room, a given value larger than the room is a 400. For chat,
  `max_completion_tokens` and `max_tokens` are synonyms; giving both with different values is a
  400. Completions accept max_tokens 0 (with echo: the prompt's logprobs only, what lm-eval's
  loglikelihood requests send).
* The fields both endpoints parse alike (prompts, truncation, stream options, sampling):
  request_fields.py. (The body as a whole was checked by `json_body.check_json_value`.)
* Logprobs: completions `logprobs` k in [0, 20] (the chosen tokens' logprobs and the k most
  likely alternatives; with `echo`, also the prompt's); chat `logprobs` true and `top_logprobs`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from pipellm.services.gateway import structured, tools
from pipellm.services.gateway.beam import check_beam, parse_beam
from pipellm.services.gateway.chat_messages import parse_messages
from pipellm.services.gateway.chat_settings import NO_CHAT, ChatSettings, chat_options
from pipellm.services.gateway.errors import bad_request, unknown_model
from pipellm.services.gateway.request_fields import (
    MAX_COUNT,
    MAX_N,
    bad_words,
    parse_prompts,
    sampling_params,
    stream_fields,
    text_options,
    truncation,
)
from pipellm.services.gateway.request_keys import (
    CHAT_KEYS,
    CHAT_NEUTRAL,
    COMPLETION_KEYS,
    COMPLETION_NEUTRAL,
    LABELS,
)
from pipellm.services.gateway.validation import (
    check_request_id,
    get_bool,
    get_int,
    get_stop,
    get_str,
    json_type,
    reject_unknown,
    reject_unsupported,
)
from pipellm.shared.codec import int32s
from pipellm.shared.generation_config import GenerationDefaults
from pipellm.shared.grammar import GrammarSpec
from pipellm.shared.messages import ChatMessage, TokenizeRequest
from pipellm.shared.sampling import MAX_LOGPROBS, SamplingParams

COMPLETION_MAX_TOKENS = 16  # completions without max_tokens (OpenAI's and vLLM's default)
NO_DEFAULTS = GenerationDefaults()

@dataclass(frozen=True)
class GenerationRequest:
    """A validated generation request, for either endpoint."""

    kind: str  # "completion" | "chat"
    model: str
    prompts: tuple[str | tuple[int, ...], ...]  # completions: each a string or token ids
    messages: tuple[ChatMessage, ...] | None  # chat
    params: SamplingParams  # per-choice parameters (seed as given)
    stop: tuple[str, ...]  # stop strings
    n: int
    stream: bool
    include_usage: bool  # stream_options.include_usage
    logprobs: bool  # return the chosen token's logprob (and params.top_logprobs alternatives);
    # compute computes them where params.logprobs (also for best_of's ranking)
    add_generation_prompt: bool  # chat (default True); False for completions
    user: str | None
    max_tokens_given: bool = True  # False: params.max_tokens is a default (for chat, an upper
    # bound the tokenizer lowers to the context left after the prompt)
    echo: bool = False  # completions: the prompt comes back before the completion (with
    # logprobs: its tokens' too, params.prompt_logprobs); chat: a last assistant message's
    # text comes back before its continuation (vLLM's)
    discard_output: bool = False  # completions with max_tokens 0: compute generates one token
    # (it always does), the answer leaves it out
    best_of: int = 0  # completions: generate this many choices (> n), answer the n with the
    # highest cumulative logprob; 0: n
    grammar: GrammarSpec | None = None  # structured output (gateway/structured.py)
    tools: tools.Tools | None = None  # chat: its tools and tool_choice (gateway/tools.py)
    ignored: tuple[str, ...] = ()  # unknown keys served without them (logged)
    request_id: str | None = None  # the client's: the response id is "chatcmpl-<it>" / "cmpl-"
    tokens_as_ids: bool = False  # return_tokens_as_token_ids: logprobs name tokens "token_id:N"
    continuous_usage: bool = False  # stream_options.continuous_usage_stats (with include_usage):
    # every chunk carries its choice's usage so far
    include_reasoning: bool = True  # chat with a reasoning parser: reasoning in the answer
    ranked_prompt_logprobs: bool = False  # vLLM's prompt_logprobs: the prompt's logprobs in
    # its ranked shape (chat: top-level; completions: per choice)
    options: dict = dataclasses.field(default_factory=dict)  # TokenizeRequest fields as parsed:
    # how the prompt is made (template kwargs, continue_final_message, truncation) and its text
    # (include_stop_str_in_output, skip_special_tokens)

    @property
    def shows_reasoning(self) -> bool:
        """Chat split by a reasoning parser, its reasoning in the answer."""
        return bool(self.options.get("reasoning_parser")) and self.include_reasoning

    @property
    def generated(self) -> int:
        """Choices generated per prompt: best_of, or n."""
        return self.best_of or self.n

    @property
    def return_token_ids(self) -> bool:
        """vLLM's return_token_ids: choices carry their token ids, and their prompt's."""
        return self.options.get("return_token_ids", False)

    @property
    def num_prompts(self) -> int:
        """Prompts it generates for: a completion's batch, or one chat. Prompt b's choices
        are b * generated .. (b + 1) * generated - 1 (answered as b * n + j, as vLLM)."""
        return len(self.prompts) or 1

    def tokenize_requests(self, request_id: str, reply_to: str, seed: int,
                          arrival: float) -> list[TokenizeRequest]:
        """What goes to the tokenizers, one per prompt; `seed` is used when the request gave
        none (every prompt's choice j samples with seed + j)."""
        one = self._tokenize_request(request_id, reply_to, seed, arrival)
        if not self.prompts:
            return [one]
        return [dataclasses.replace(
            one, prompt_index=b, num_prompts=len(self.prompts),
            prompt_text=p if isinstance(p, str) else None,
            prompt_ids=None if isinstance(p, str) else int32s(p))
            for b, p in enumerate(self.prompts)]

    def _tokenize_request(self, request_id: str, reply_to: str, seed: int,
                          arrival: float) -> TokenizeRequest:
        messages = None if self.messages is None else list(self.messages)
        params = self.params
        if params.seed is None:
            params = dataclasses.replace(params, seed=seed)
        return TokenizeRequest(
            request_id=request_id, reply_to=reply_to, params=params, messages=messages,
            add_generation_prompt=self.add_generation_prompt,
            stop=list(self.stop), n=self.generated,
            # chat without max_tokens: up to the context (at most the model's default);
            # completions keep theirs (the model's default, else OpenAI's 16)
            max_tokens_auto=self.kind == "chat" and not self.max_tokens_given,
            arrival=arrival, grammar=self.grammar,
            tools=None if self.tools is None else list(self.tools.specs), **self.options)


def parse_completion(body: Any, model_name: str, *, defaults: GenerationDefaults = NO_DEFAULTS,
                     strict: bool = False, adapters: frozenset[str] = frozenset(),
                     ) -> GenerationRequest:
    """Validate a `/v1/completions` body. `prompt` is a non-empty string, a list of one string,
    a non-empty list of token ids, or a batch: a list of those. Unknown keys are ignored
    (listed in `ignored`), or with `strict` a 400. `model` names `model_name` or one of the
    LoRA `adapters` (then params.lora_name)."""
    ignored = None if strict else []
    model = _check_body(body, model_name, COMPLETION_KEYS, COMPLETION_NEUTRAL, ignored,
                        adapters)
    prompts = parse_prompts(body.get("prompt"))
    n = get_int(body, "n", 1, lo=1, hi=MAX_N)
    best_of = get_int(body, "best_of", n, lo=1, hi=MAX_N)
    if best_of < n:
        raise bad_request(f"best_of ({best_of}) must be at least n ({n})", "best_of")
    beam = parse_beam(body, n, best_of)
    if best_of > n and get_bool(body, "stream", False) and not beam:
        raise bad_request("best_of > n cannot be streamed (the best are known at the end)",
                          "best_of")
    logprobs = get_int(body, "logprobs", lo=0, hi=MAX_LOGPROBS)
    echo = get_bool(body, "echo", False)
    max_tokens = get_int(body, "max_tokens", lo=0, hi=MAX_COUNT)
    ranked = get_int(body, "prompt_logprobs", lo=0, hi=MAX_LOGPROBS)
    echoed = logprobs if echo else None
    if None not in (ranked, echoed) and ranked != echoed:
        raise bad_request("prompt_logprobs and echo with logprobs ask for different numbers of "
                          "alternatives; give one", "prompt_logprobs")
    return _finish(body, "completion", model, prompts=prompts,
                   messages=None, n=n, logprobs=logprobs is not None, top_logprobs=logprobs or 0,
                   prompt_logprobs=echoed if echoed is not None else ranked, echo=echo,
                   ranked_prompt_logprobs=ranked is not None,
                   discard_output=max_tokens == 0,
                   max_tokens=1 if max_tokens == 0 else max_tokens, max_param="max_tokens",
                   defaults=defaults, fallback_max_tokens=COMPLETION_MAX_TOKENS,
                   add_generation_prompt=False, beam=beam,
                   best_of=best_of if best_of > n and not beam else 0,
                   ignored=tuple(ignored or ()), lora_name=_lora_name(model, model_name))


def parse_chat(body: Any, model_name: str, *, defaults: GenerationDefaults = NO_DEFAULTS,
               chat: ChatSettings = NO_CHAT, strict: bool = False,
               adapters: frozenset[str] = frozenset()) -> GenerationRequest:
    """Validate a `/v1/chat/completions` body. Messages: chat_messages.py. `chat`: the
    server's chat flags (a request's `separate_reasoning: false`, SGLang's, leaves the
    reasoning in the content; `include_reasoning: false`, vLLM's, drops it). Unknown keys are
    ignored (listed in `ignored`), or with `strict` a 400. `model` as for parse_completion."""
    ignored = None if strict else []
    model = _check_body(body, model_name, CHAT_KEYS, CHAT_NEUTRAL, ignored, adapters)
    for label in LABELS:
        get_str(body, label)
    messages = parse_messages(body.get("messages"), ignored)
    n = get_int(body, "n", 1, lo=1, hi=MAX_N)
    logprobs = get_bool(body, "logprobs", False)
    top_logprobs = get_int(body, "top_logprobs", 0, lo=0, hi=MAX_LOGPROBS)
    if top_logprobs and not logprobs:
        raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
    max_tokens = get_int(body, "max_tokens", hi=MAX_COUNT)
    max_completion = get_int(body, "max_completion_tokens", hi=MAX_COUNT)
    if max_completion is not None and max_tokens is not None and max_completion != max_tokens:
        raise bad_request("max_tokens and max_completion_tokens differ; give only one",
                          "max_completion_tokens")
    param = "max_tokens"
    if max_completion is not None:
        max_tokens, param = max_completion, "max_completion_tokens"
    options = chat_options(body, chat)
    add_generation_prompt = options.pop("add_generation_prompt")
    ranked = get_int(body, "prompt_logprobs", lo=0, hi=MAX_LOGPROBS)
    return _finish(body, "chat", model, prompts=(), messages=messages,
                   prompt_logprobs=ranked, ranked_prompt_logprobs=ranked is not None,
                   n=n, logprobs=logprobs, top_logprobs=top_logprobs, max_tokens=max_tokens,
                   max_param=param, defaults=defaults, fallback_max_tokens=None,
                   add_generation_prompt=add_generation_prompt, chat_options=options,
                   echo=get_bool(body, "echo", False),
                   tools=tools.parse_tools(body, chat.tool_parser), beam=parse_beam(body, n, n),
                   include_reasoning=get_bool(body, "include_reasoning", True),
                   ignored=tuple(ignored or ()), lora_name=_lora_name(model, model_name))


def calls_keep_specials(fields: dict) -> bool:
    """Whether the request's tool format needs special tokens in the text."""
    return fields.get("tools") is not None and fields["tools"].reads_special_tokens


def _check_body(body: Any, model_name: str, allowed: frozenset[str],
                neutral: dict[str, tuple], ignored: list[str] | None,
                adapters: frozenset[str] = frozenset()) -> str:
    """The model the body names (`model_name` or one of the LoRA `adapters`), once it is an
    object that names one, asks for no unsupported feature and has only known keys (the others
    go to `ignored`; without that list they are a 400)."""
    reject_unsupported(check_model(body, model_name, allowed, ignored, adapters), neutral)
    return get_str(body, "model", model_name)


def check_model(body: Any, model_name: str, allowed: frozenset[str],
                ignored: list[str] | None = None, adapters: frozenset[str] = frozenset(),
                ) -> dict:
    """`body`, once it is an object that names our model, one of its LoRA `adapters` or none,
    its keys not in `allowed` appended to `ignored` (without that list: a 400). An unknown
    model is a 404 model_not_found."""
    if not isinstance(body, dict):
        raise bad_request(f"The request body must be a JSON object, got {json_type(body)}")
    reject_unknown(body, allowed, ignored)
    model = get_str(body, "model", model_name)
    if model != model_name and model not in adapters:
        raise unknown_model(model)
    return body


def _lora_name(model: str, model_name: str) -> str:
    """The LoRA adapter a request names as its `model` ("" for the base model)."""
    return "" if model == model_name else model


def _finish(body: dict, kind: str, model: str, *, max_tokens: int | None, max_param: str,
            defaults: GenerationDefaults, fallback_max_tokens: int | None, n: int, logprobs: bool,
            top_logprobs: int, prompt_logprobs: int | None = None, beam: dict,
            chat_options: dict | None = None, lora_name: str = "",
            **fields: Any) -> GenerationRequest:
    """Validate the fields both endpoints share and build the request (`beam`: its beam
    search fields, pipellm/services/gateway/beam.py; `chat_options`: how chat renders its prompt;
    `lora_name`: the adapter it generates with)."""
    stream, include_usage, continuous_usage = stream_fields(body)
    priority = get_int(body, "priority", 0, lo=-MAX_COUNT - 1, hi=MAX_COUNT)
    params = sampling_params(  # best_of ranks choices by their logprobs: compute sends them
        body, logprobs=logprobs or fields.get("best_of", 0) > 0, top_logprobs=top_logprobs,
        prompt_logprobs=prompt_logprobs, max_param=max_param, defaults=defaults,
        max_tokens=defaults.max_tokens_for(max_tokens, fallback_max_tokens), beam=beam)
    if lora_name:
        params = dataclasses.replace(params, lora_name=lora_name)
    grammar = structured.parse_grammar(body)
    calls = fields.get("tools") and fields["tools"].grammar()  # required or a named function
    if calls is not None:
        if grammar is not None:
            raise bad_request("tool_choice required or a named function cannot be combined "
                              "with another output constraint", grammar.param)
        grammar = calls
    if beam:
        check_beam(top_logprobs, fields.get("echo", False), grammar is not None)
    return GenerationRequest(
        kind=kind, model=model, params=params, stop=get_stop(body), n=n, stream=stream,
        include_usage=include_usage, continuous_usage=continuous_usage, logprobs=logprobs,
        user=get_str(body, "user"), max_tokens_given=max_tokens is not None, grammar=grammar,
        request_id=check_request_id(get_str(body, "request_id"), "request_id"),
        options={**(chat_options or {}), **truncation(body), **text_options(body),
                 **({"skip_special_tokens": False} if calls_keep_specials(fields) else {}),
                 "return_token_ids": get_bool(body, "return_token_ids", False),
                 "add_special_tokens": get_bool(body, "add_special_tokens", kind != "chat"),
                 "bad_words": bad_words(body), "priority": priority},
        tokens_as_ids=get_bool(body, "return_tokens_as_token_ids", False),
        **fields)
