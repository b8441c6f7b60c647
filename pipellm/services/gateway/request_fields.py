"""The request fields both endpoints parse the same way: the prompts of a completion, prompt
truncation, streaming options, the sampling parameters and logit_bias. Each raises APIError
(a 400 naming the field) on a bad value; integers are bounded before they reach the codec."""

from __future__ import annotations

from typing import Any

from pipellm.services.gateway.errors import APIError, bad_request
from pipellm.services.gateway.validation import (
    MAX_TOKEN_ID,
    get_bool,
    get_int,
    get_number,
    get_str,
    is_int,
    json_type,
    token_ids,
)
from pipellm.shared.generation_config import GenerationDefaults
from pipellm.shared.sampling import InvalidParams, SamplingParams

MAX_N = 16
MAX_PROMPTS = 1024  # prompts of one batched completion
MAX_COUNT = 2**31 - 1  # token counts fit int32 everywhere downstream
MAX_LOGIT_BIAS = 1024  # tokens one request may bias
MAX_BAD_WORDS = 256
MAX_SEED = 2**63 - MAX_N  # choice i samples with seed + i, which must stay below 2^63


def parse_prompts(prompt: Any) -> tuple[str | tuple[int, ...], ...]:
    """The prompts of the accepted `prompt` shapes: a string, a list of token ids, or a batch
    (a list of strings and token-id lists, at most MAX_PROMPTS)."""
    if prompt is None:
        raise bad_request("prompt is required", "prompt")
    if isinstance(prompt, list) and prompt and not is_int(prompt[0]):
        if len(prompt) > MAX_PROMPTS:
            raise bad_request(f"a batch holds at most {MAX_PROMPTS} prompts, got "
                              f"{len(prompt)}", "prompt")
        return tuple(_one_prompt(p, f"prompt[{i}]") for i, p in enumerate(prompt))
    return (_one_prompt(prompt, "prompt"),)


def _one_prompt(prompt: Any, param: str) -> str | tuple[int, ...]:
    if isinstance(prompt, str | list) and not prompt:
        raise bad_request(f"{param} must not be empty", param)
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        return token_ids(prompt, param)
    raise bad_request(f"{param} must be a string or a list of token ids, or prompt a list of "
                      f"those, got {json_type(prompt)}", param)


def truncation(body: dict) -> dict:
    """vLLM's truncate_prompt_tokens (-1: to the context; k >= 1: keep k prompt tokens) and
    truncation_side ("left": the last k, its default; "right": the first k)."""
    k = get_int(body, "truncate_prompt_tokens", 0, lo=-1, hi=MAX_COUNT)
    if k == 0 and body.get("truncate_prompt_tokens") is not None:
        raise bad_request("truncate_prompt_tokens must be -1 or at least 1",
                          "truncate_prompt_tokens")
    return {"truncate_prompt_tokens": k, "truncation_side": truncation_side(body, "left")}


def truncation_side(body: dict, default: str) -> str:
    """vLLM's truncation_side: "left" keeps the last k tokens, "right" the first k; unset, the
    runner's `default` (vLLM's: "left" for generation, "right" for pooling)."""
    side = get_str(body, "truncation_side", default)
    if side not in ("left", "right"):
        raise bad_request("truncation_side must be 'left' or 'right'", "truncation_side")
    return side


def text_options(body: dict) -> dict:
    """How the output becomes text: include_stop_str_in_output (a matched stop string stays at
    the end of the text; SGLang's no_stop_trim) and skip_special_tokens (true: special tokens
    are left out), vLLM's."""
    include = get_bool(body, "include_stop_str_in_output", False)
    return {"include_stop_str_in_output": get_bool(body, "no_stop_trim", False) or include,
            "skip_special_tokens": get_bool(body, "skip_special_tokens", True)}


def stream_fields(body: dict) -> tuple[bool, bool, bool]:
    """(stream, include_usage, continuous_usage_stats); stream_options is only allowed together
    with stream: true."""
    stream = get_bool(body, "stream", False)
    options = body.get("stream_options")
    if options is None:
        return stream, False, False
    if not stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")
    if not isinstance(options, dict):
        raise bad_request(f"stream_options must be an object, got {json_type(options)}",
                          "stream_options")
    for key in options:
        if key not in ("include_usage", "continuous_usage_stats", "include_obfuscation"):
            raise bad_request(f"Unrecognized stream_options argument supplied: {key}"[:300],
                              "stream_options")
    get_bool(options, "include_obfuscation", False)  # type-checked; we never obfuscate
    usage = get_bool(options, "include_usage", False)
    return stream, usage, usage and get_bool(options, "continuous_usage_stats", False)


def sampling_params(body: dict, *, max_tokens: int | None, logprobs: bool, top_logprobs: int,
                     prompt_logprobs: int | None, max_param: str,
                     defaults: GenerationDefaults, beam: dict) -> SamplingParams:
    """SamplingParams from the sampling fields, the model's `defaults` where they are unset;
    range errors become 400s naming the field."""
    stop_ids = body.get("stop_token_ids")
    sampling = defaults.apply({
        "temperature": get_number(body, "temperature", None),
        "top_k": get_int(body, "top_k", None, hi=MAX_COUNT),
        "top_p": get_number(body, "top_p", None),
        "min_p": get_number(body, "min_p", None),
        "repetition_penalty": get_number(body, "repetition_penalty", None),
    })
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            **sampling,
            seed=get_int(body, "seed", hi=MAX_SEED),
            ignore_eos=get_bool(body, "ignore_eos", False),
            min_tokens=get_int(body, "min_tokens", 0, hi=MAX_COUNT),
            stop_token_ids=() if stop_ids is None else token_ids(stop_ids, "stop_token_ids"),
            logprobs=logprobs,
            top_logprobs=top_logprobs,
            prompt_logprobs=prompt_logprobs,
            presence_penalty=get_number(body, "presence_penalty", 0.0),
            frequency_penalty=get_number(body, "frequency_penalty", 0.0),
            logit_bias=logit_bias(body.get("logit_bias")),
            allowed_token_ids=() if body.get("allowed_token_ids") is None else
            token_ids(body["allowed_token_ids"], "allowed_token_ids"),
            cache_salt=cache_salt(body),
            **beam,
        )
    except InvalidParams as exc:
        param = max_param if exc.param == "max_tokens" else exc.param
        raise APIError(400, str(exc), param=param) from exc


def cache_salt(body: dict) -> str:
    """vLLM's cache_salt: a non-empty string (at most 256 characters here), or absent."""
    salt = get_str(body, "cache_salt")
    if salt is not None and not 0 < len(salt) <= 256:
        raise bad_request("cache_salt must be a non-empty string of at most 256 characters",
                          "cache_salt")
    return salt or ""


def logit_bias(value: Any) -> tuple[tuple[int, float], ...]:
    """OpenAI's logit_bias: {"<token id>": bias in [-100, 100], ...} -> ((id, bias), ...)."""
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise bad_request(f"logit_bias must be an object mapping token ids to biases, got "
                          f"{json_type(value)}", "logit_bias")
    if len(value) > MAX_LOGIT_BIAS:
        raise bad_request(f"logit_bias may hold at most {MAX_LOGIT_BIAS} tokens", "logit_bias")
    out = []
    for key, bias in value.items():
        if not (len(key) <= 10 and key.isascii() and key.isdigit() and int(key) <= MAX_TOKEN_ID):
            raise bad_request(f"logit_bias keys must be token ids, got {key!r}"[:200],
                              "logit_bias")
        if isinstance(bias, bool) or not isinstance(bias, int | float):
            raise bad_request(f"logit_bias[{key!r}] must be a number", "logit_bias")
        out.append((int(key), float(bias)))
    return tuple(out)


def bad_words(body: dict) -> list[str]:
    """vLLM's bad_words: words (strings) the output may not contain, at most MAX_BAD_WORDS."""
    words = body.get("bad_words")
    if words is None:
        return []
    if not (isinstance(words, list) and all(isinstance(w, str) and w.strip() for w in words)):
        raise bad_request("bad_words must be an array of non-empty strings", "bad_words")
    if len(words) > MAX_BAD_WORDS:
        raise bad_request(f"bad_words holds at most {MAX_BAD_WORDS} words", "bad_words")
    return words
