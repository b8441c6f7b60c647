"""An OpenAI Responses request body -> the chat body `protocol.parse_chat` validates -> a
GenerationRequest. The translation checks only what is the Responses API's (items, tools,
text.format, reasoning); the rest is the chat path's checks.

    instructions                        a first system message (not carried to a next turn)
    input: string                       one user message
    input items                         chat messages (items.py); a last assistant message
                                        in_progress or incomplete is continued
    previous_response_id                its stored input and output items come first
    tools (function, custom, namespace) function tools (custom_tools.py, namespaces.py);
                                        built-in tools (web_search, file_search,
                                        computer_use, ...) are skipped, noted in the answer
    tool_choice                         auto | none | required | {"type": "function" or
                                        "custom", "name"} | allowed_tools
    max_output_tokens                   max_tokens (without it: up to the context)
    text.format json_schema|json_object response_format
    reasoning.effort                    chat_template_kwargs reasoning_effort; "none" and
                                        "minimal" also enable_thinking false
    include message.output_text.logprobs, top_logprobs      logprobs (either), top_logprobs
    temperature, top_p, parallel_tool_calls, user, stream  as in chat, and vLLM's extras
    (top_k, seed, stop, min_p, ignore_eos, chat_template_kwargs, ...)
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from pipellm.services.gateway import protocol
from pipellm.services.gateway.chat_settings import NO_CHAT
from pipellm.services.gateway.errors import bad_request
from pipellm.services.gateway.responses_api import custom_tools, namespaces
from pipellm.services.gateway.responses_api.items import chat_messages, input_items, partial
from pipellm.services.gateway.validation import json_type, reject_unknown

KEYS = frozenset({
    "model", "input", "instructions", "tools", "tool_choice", "max_output_tokens", "text",
    "reasoning", "temperature", "top_p", "include", "top_logprobs", "store", "background",
    "stream", "previous_response_id", "metadata", "parallel_tool_calls", "user", "truncation",
    "service_tier", "prompt_cache_key", "safety_identifier", "max_tool_calls", "stream_options",
    "conversation", "prompt", "prompt_cache_retention",
    # vLLM's extras
    "top_k", "seed", "stop", "min_p", "repetition_penalty", "request_id", "priority",
    "ignore_eos", "min_tokens", "chat_template_kwargs", "presence_penalty",
    "frequency_penalty", "logit_bias", "stop_token_ids", "skip_special_tokens",
    "include_stop_str_in_output", "structured_outputs", "include_reasoning", "cache_salt",
    "vllm_xargs", "kv_transfer_params", "session_id", "watermarking",
    "enable_response_messages",
})
# given to the chat path as they are (it validates them; vLLM's fields for what pipellm does
# not do are a 400 there unless null or their no-op value)
_PASSED = ("temperature", "top_p", "top_k", "seed", "stop", "min_p", "repetition_penalty",
           "parallel_tool_calls", "user", "stream", "request_id", "priority", "ignore_eos",
           "min_tokens", "presence_penalty", "frequency_penalty", "logit_bias",
           "stop_token_ids", "skip_special_tokens", "include_stop_str_in_output",
           "structured_outputs", "include_reasoning", "cache_salt", "vllm_xargs",
           "kv_transfer_params", "session_id", "watermarking")
_LOGPROBS = "message.output_text.logprobs"
_INCLUDES = frozenset({_LOGPROBS, "reasoning.encrypted_content"})
_NO_THINKING = ("none", "minimal")


@dataclasses.dataclass(frozen=True)
class Parsed:
    """A validated Responses request: what generates, and what the answer echoes."""

    req: protocol.GenerationRequest
    input_items: list[dict]  # the whole conversation before the output (for the next turn)
    echo: dict  # the request fields a Response object repeats (instructions, tools, ...)
    store: bool
    background: bool
    notes: list[str]  # what was skipped (built-in tools): logged, and in the answer's metadata


def parse_request(body: Any, model_name: str, history: list[dict] | None = None, *,
                  defaults=protocol.NO_DEFAULTS, chat=NO_CHAT,
                  strict: bool = False, adapters: frozenset[str] = frozenset()) -> Parsed:
    """`history`: the stored items of previous_response_id (its input and its output);
    `model` may name one of the LoRA `adapters`."""
    if not isinstance(body, dict):
        raise bad_request(f"The request body must be a JSON object, got {json_type(body)}")
    ignored: list[str] | None = None if strict else []
    reject_unknown(body, KEYS, ignored)
    for key in ("conversation", "prompt"):
        if body.get(key) is not None:
            raise bad_request(f"`{key}` is not supported; send `input` (and "
                              "previous_response_id)", key)
    if body.get("enable_response_messages"):
        raise bad_request("`enable_response_messages` is not supported",
                          "enable_response_messages")
    items = (history or []) + input_items(body.get("input"))
    notes: list[str] = []
    chat_body = {"messages": chat_messages(body.get("instructions"), items)}
    if items and partial(items[-1]):  # the model continues it (vLLM's rule)
        chat_body.update(continue_final_message=True, add_generation_prompt=False)
    chat_body.update({k: body[k] for k in _PASSED if body.get(k) is not None})
    if body.get("model") is not None:
        chat_body["model"] = body["model"]
    if body.get("max_output_tokens") is not None:
        chat_body["max_tokens"] = body["max_output_tokens"]
    tools = _tools(body.get("tools"), notes)
    if tools:
        chat_body["tools"] = tools
        chat_body["tool_choice"] = _tool_choice(body.get("tool_choice"))
    chat_body.update(_format(body.get("text")))
    chat_body.update(_reasoning(body.get("reasoning"), body.get("chat_template_kwargs")))
    chat_body.update(_include(body))
    req = protocol.parse_chat(chat_body, model_name, defaults=defaults, chat=chat,
                              strict=strict, adapters=adapters)
    req = dataclasses.replace(req, ignored=req.ignored + tuple(ignored or ()))
    background = _flag(body, "background", False)
    store = _flag(body, "store", True)
    if background and not store:
        raise bad_request("background responses must be stored (store: true)", "background")
    return Parsed(req, items, _echo(body), store, background, notes)


def _flag(body: dict, key: str, default: bool) -> bool:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"{key} must be a boolean", key)
    return value


def _tools(raw: Any, notes: list[str]) -> list[dict]:
    """Function and custom tools as chat tools (custom_tools.py); the built-in ones this
    server cannot run are skipped."""
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise bad_request(f"tools must be an array, got {json_type(raw)}", "tools")
    out = []
    for i, tool in enumerate(raw):
        if not isinstance(tool, dict):
            raise bad_request(f"tools[{i}] must be an object", f"tools[{i}]")
        if tool.get("type") == "custom":
            out.append(custom_tools.as_function(tool))
        elif tool.get("type") == "namespace":
            out += [_function(t) for t in namespaces.functions(tool)]
        elif tool.get("type") == "function":
            out.append(_function(tool))
        else:
            notes.append(f"tools[{i}]: the built-in tool {str(tool.get('type'))[:40]!r} is "
                         "not run by this server and was skipped")
    return out


def _function(tool: dict) -> dict:
    """A Responses function tool as the chat path's."""
    fn = {"name": tool.get("name"), "parameters": tool.get("parameters") or
          {"type": "object", "properties": {}}}
    if tool.get("description") is not None:
        fn["description"] = tool["description"]
    return {"type": "function", "function": fn}


def _tool_choice(raw: Any) -> Any:
    if raw is None or raw in ("auto", "none", "required"):
        return raw or "auto"
    if isinstance(raw, dict) and raw.get("type") in ("function", "custom") and isinstance(
            raw.get("name"), str):
        return {"type": "function", "function": {"name": raw["name"]}}
    if isinstance(raw, dict) and raw.get("type") == "allowed_tools":  # the chat path's shape
        tools = raw.get("tools") if isinstance(raw.get("tools"), list) else []
        return {"type": "allowed_tools", "allowed_tools": {"mode": raw.get("mode"), "tools": [
            {"type": "function", "function": {"name": t.get("name")}}
            for t in tools if isinstance(t, dict)]}}
    raise bad_request("tool_choice must be auto, none, required or {\"type\": \"function\" "
                      "(or \"custom\"), \"name\"}", "tool_choice")


def _format(text: Any) -> dict:
    """text.format as response_format."""
    if text is None:
        return {}
    fmt = text.get("format") if isinstance(text, dict) else None
    if fmt is None:
        return {}
    if not isinstance(fmt, dict):
        raise bad_request("text.format must be an object", "text.format")
    kind = fmt.get("type")
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"response_format": {"type": "json_object"}}
    if kind == "json_schema":
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"response_format": {"type": "json_schema", "json_schema": schema}}
    raise bad_request("text.format.type must be text, json_object or json_schema",
                      "text.format.type")


def _reasoning(raw: Any, kwargs: Any) -> dict:
    """reasoning.effort into the chat template's kwargs (a request's own win)."""
    effort = raw.get("effort") if isinstance(raw, dict) else None
    if effort is None:
        return {"chat_template_kwargs": kwargs} if kwargs is not None else {}
    if not isinstance(effort, str):
        raise bad_request("reasoning.effort must be a string", "reasoning.effort")
    out: dict[str, Any] = {"reasoning_effort": effort}
    if effort in _NO_THINKING:
        out["enable_thinking"] = False
    return {"chat_template_kwargs": {**out, **(kwargs if isinstance(kwargs, dict) else {})}}


def _include(body: dict) -> dict:
    include = body.get("include") or []
    if not isinstance(include, list) or not all(isinstance(x, str) for x in include):
        raise bad_request("include must be an array of strings", "include")
    unknown = [x for x in include if x not in _INCLUDES]
    if unknown:
        raise bad_request(f"include: {unknown[0][:60]!r} is not supported", "include")
    top = body.get("top_logprobs")
    if _LOGPROBS not in include and not top:
        return {}
    return {"logprobs": True, **({"top_logprobs": top} if top is not None else {})}


def _echo(body: dict) -> dict:
    """What a Response object repeats of its request (OpenAI's defaults where absent)."""
    return {
        "instructions": body.get("instructions"),
        "tools": [t for t in body.get("tools") or [] if isinstance(t, dict)],
        "tool_choice": body.get("tool_choice") or "auto",
        "temperature": body.get("temperature"), "top_p": body.get("top_p"),
        "max_output_tokens": body.get("max_output_tokens"),
        "previous_response_id": body.get("previous_response_id"),
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "text": body.get("text") or {"format": {"type": "text"}},
        "reasoning": body.get("reasoning"), "metadata": body.get("metadata") or {},
        "truncation": body.get("truncation") or "disabled", "user": body.get("user"),
        "top_logprobs": body.get("top_logprobs"), "service_tier": "auto",
        "store": body.get("store", True) is not False,
        "background": bool(body.get("background")),
    }


def dump(items: list[dict]) -> str:
    return json.dumps(items, ensure_ascii=False, separators=(",", ":"))
