"""An Anthropic Messages request body -> the OpenAI chat body `protocol.parse_chat` validates
-> a GenerationRequest. The translation checks only what is Anthropic's (the block kinds,
max_tokens, the tools' and thinking's shapes); everything else is the chat path's checks.

    system (string | text blocks)      a first system message (blocks joined by newlines)
    user text / tool_result blocks     user messages / `tool` messages, in the blocks' order
    assistant text / tool_use          one assistant message: content, tool_calls (input as
      / thinking blocks                JSON text), reasoning_content (redacted thinking dropped)
    a last assistant message           a prefill: continue_final_message (as Anthropic's)
    tools (custom)                     function tools; server tools (web_search_..., bash_...)
                                       are skipped and noted in the log
    tool_choice auto|any|none|tool     auto | required | none | the named function;
                                       disable_parallel_tool_use: parallel_tool_calls false
    stop_sequences, top_k, ...         stop, top_k, temperature, top_p, stream
    thinking enabled|adaptive|disabled chat_template_kwargs.enable_thinking, and with a
                                       reasoning parser thinking_token_budget = budget_tokens
                                       (display "omitted": include_reasoning false)
    output_config.format json_schema   response_format json_schema (the text follows it)
    metadata.user_id                   user
    seed, min_p, guided_regex, ...     the same (the chat path's extensions, EXTRAS); thinking's
                                       enable_thinking wins over a chat_template_kwargs' own

max_tokens is required (>= 1) and is a ceiling: like a chat request without max_tokens, it is
lowered to the room the context leaves after the prompt (Claude Code asks for 32000).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from pipellm.services.gateway import protocol, structured
from pipellm.services.gateway.chat_settings import NO_CHAT, ChatSettings
from pipellm.services.gateway.errors import bad_request
from pipellm.services.gateway.messages_api.content import TOOL_CHANGES, chat_messages
from pipellm.services.gateway.validation import is_int, json_type, reject_unknown

KEYS = frozenset({"model", "messages", "system", "max_tokens", "metadata", "stop_sequences",
                  "stream", "temperature", "top_p", "top_k", "tools", "tool_choice", "thinking",
                  "service_tier", "container", "mcp_servers", "context_management", "output_config",
                  # accepted, no use here
                  "cache_control", "diagnostics", "inference_geo", "speed", "user_profile_id",
                  "workspace_id"})
# the chat path's extensions a request may add (vLLM's sampling extras, structured outputs,
# template variables): passed through as they are
EXTRAS = frozenset({"seed", "min_p", "repetition_penalty", "frequency_penalty",
                    "presence_penalty", "min_tokens", "ignore_eos", "stop_token_ids",
                    "logit_bias", "request_id", "priority", "cache_salt", "chat_template_kwargs",
                    *structured.KEYS})
_SAMPLING = (("temperature", "temperature"), ("top_p", "top_p"), ("top_k", "top_k"),
             ("stream", "stream"), ("stop_sequences", "stop"))
_CHOICES = {"auto": "auto", "any": "required", "none": "none"}


def parse_request(body: Any, model_name: str, *, defaults=protocol.NO_DEFAULTS,
                  chat: ChatSettings = NO_CHAT, strict: bool = False,
                  count_only: bool = False, adapters: frozenset[str] = frozenset(),
                  ) -> tuple[protocol.GenerationRequest, list[str]]:
    """(the validated request, notes for the log: what was skipped). `count_only`:
    /v1/messages/count_tokens' body (no max_tokens). Unknown keys are ignored (the gateway
    logs them), or with `strict` a 400, as on the chat path; `model` may name one of the LoRA
    `adapters`."""
    if not isinstance(body, dict):
        raise bad_request(f"The request body must be a JSON object, got {json_type(body)}")
    ignored: list[str] | None = None if strict else []
    reject_unknown(body, KEYS | EXTRAS, ignored)
    notes: list[str] = []
    chat_body = to_chat_body(body, notes, reasoning=bool(chat.reasoning_parser),
                             count_only=count_only)
    req = protocol.parse_chat(chat_body, model_name, defaults=defaults, chat=chat,
                              strict=strict, adapters=adapters)
    # a ceiling, lowered to the context's room by the tokenizer (max_tokens_auto)
    return dataclasses.replace(req, max_tokens_given=False,
                               ignored=req.ignored + tuple(ignored or ())), notes


def to_chat_body(body: dict, notes: list[str], *, reasoning: bool,
                 count_only: bool = False) -> dict:
    """The OpenAI chat body of an Anthropic one (its top-level keys already checked).
    `reasoning`: the server splits reasoning (--reasoning-parser)."""
    out: dict[str, Any] = {}
    if not count_only:
        out["max_tokens"] = _max_tokens(body.get("max_tokens"))
    if body.get("model") is not None:
        out["model"] = body["model"]
    messages, prefill = chat_messages(body.get("system"), body.get("messages"), notes)
    out["messages"] = messages
    if prefill:  # Anthropic continues a last assistant message
        out.update(continue_final_message=True, add_generation_prompt=False)
    for src, dst in _SAMPLING:
        if body.get(src) is not None:
            out[dst] = body[src]
    user = _user(body.get("metadata"))
    if user is not None:
        out["user"] = user
    if body.get("mcp_servers"):
        raise bad_request("mcp_servers are not supported", "mcp_servers")
    tools = _tools(resolved_tools(body.get("tools"), body.get("messages")), notes)
    if tools:
        out["tools"] = tools
    out.update(_tool_choice(body.get("tool_choice"), bool(tools)))
    out.update({k: v for k, v in body.items() if k in EXTRAS})
    thinking = _thinking(body.get("thinking"), reasoning)
    if isinstance(out.get("chat_template_kwargs"), dict) and "chat_template_kwargs" in thinking:
        thinking["chat_template_kwargs"] = {**out["chat_template_kwargs"],
                                            **thinking["chat_template_kwargs"]}
    out.update(thinking)
    output = _output(body.get("output_config"))
    if "reasoning_effort" in output:  # a template variable, beside the others
        effort = output.pop("reasoning_effort")
        out["chat_template_kwargs"] = {"reasoning_effort": effort,
                                       **(out.get("chat_template_kwargs") or {})}
    out.update(output)
    return out


def _max_tokens(value: Any) -> int:
    if value is None:
        raise bad_request("max_tokens: Field required", "max_tokens")
    if not is_int(value) or value < 1:
        raise bad_request(f"max_tokens must be an integer of at least 1, got "
                          f"{json.dumps(value)[:40]}", "max_tokens")
    return value


def _user(metadata: Any) -> str | None:
    """metadata.user_id (the only field Anthropic's metadata has), as OpenAI's `user`."""
    if metadata is None:
        return None
    if not isinstance(metadata, dict):
        raise bad_request(f"metadata must be an object, got {json_type(metadata)}", "metadata")
    user = metadata.get("user_id")
    if user is not None and not isinstance(user, str):
        raise bad_request("metadata.user_id must be a string", "metadata.user_id")
    return user


def resolved_tools(raw: Any, messages: Any) -> Any:
    """`tools` after the tool_addition / tool_removal blocks of system messages, in order
    (vLLM's rule: a tool added by value is declared, one added by reference stays, a removed
    one is dropped; `defer_loading` has no use here: the model sees every tool)."""
    changes = [(b, f"messages[{i}].content[{j}]") for i, m in enumerate(
        messages if isinstance(messages, list) else []) if isinstance(m, dict)
        and m.get("role") == "system" and isinstance(m.get("content"), list)
        for j, b in enumerate(m["content"]) if isinstance(b, dict)
        and b.get("type") in TOOL_CHANGES]
    if not changes:
        return raw
    tools = {t.get("name"): t for t in (raw if isinstance(raw, list) else [])
             if isinstance(t, dict)}
    removed: set = set()
    for block, where in changes:
        change, kind = block.get("tool"), block["type"]
        by_value = isinstance(change, dict) and change.get("type") == "tool_definition"
        name = (change.get("definition") or {}).get("name") if by_value else (
            change.get("name") if isinstance(change, dict) else None)
        if not isinstance(name, str) or (by_value and kind == "tool_removal"):
            raise bad_request(f"{where}.tool must be a tool_reference (a name) or, to add, a "
                              "tool_definition", f"{where}.tool")
        if by_value:
            tools[name] = change["definition"]
        elif name not in tools:
            raise bad_request(f"{kind} references tool {name[:64]!r}, which is not declared "
                              "in tools", f"{where}.tool")
        (removed.add if kind == "tool_removal" else removed.discard)(name)
    return [t for n, t in tools.items() if n not in removed]


def _tools(raw: Any, notes: list[str]) -> list[dict]:
    """The custom tools as OpenAI function tools; server tools are skipped (noted)."""
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise bad_request(f"tools must be an array, got {json_type(raw)}", "tools")
    out = []
    for i, tool in enumerate(raw):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise bad_request(f"{where} must be an object", where)
        kind = tool.get("type")
        if kind not in (None, "custom"):
            notes.append(f"{where}: the server tool {str(kind)[:60]!r} is skipped "
                         "(server tools are not run here)")
            continue
        schema = tool.get("input_schema")
        if not isinstance(schema, dict):
            raise bad_request(f"{where}.input_schema (a JSON schema object) is required",
                              f"{where}.input_schema")
        out.append({"type": "function", "function": {
            "name": tool.get("name"), "description": tool.get("description") or "",
            "parameters": schema}})
    return out


def _tool_choice(choice: Any, has_tools: bool) -> dict:
    """tool_choice (and parallel_tool_calls) of the chat body."""
    if choice is None:
        return {}
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind not in ("auto", "any", "none", "tool"):
        raise bad_request('tool_choice must be {"type": "auto" | "any" | "none" | "tool"}',
                          "tool_choice")
    out: dict[str, Any] = {}
    parallel = choice.get("disable_parallel_tool_use")
    if parallel is not None and not isinstance(parallel, bool):
        raise bad_request("tool_choice.disable_parallel_tool_use must be a boolean",
                          "tool_choice.disable_parallel_tool_use")
    if parallel and has_tools:
        out["parallel_tool_calls"] = False
    if kind == "tool":
        if not isinstance(choice.get("name"), str):
            raise bad_request('tool_choice {"type": "tool"} needs a string `name`',
                              "tool_choice.name")
        out["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    elif has_tools or kind == "any":  # no tools: auto and none ask for nothing
        out["tool_choice"] = _CHOICES[kind]
    return out


def _thinking(thinking: Any, reasoning: bool) -> dict:
    """The chat path's reasoning controls of `thinking`. The budget is enforced only where the
    server splits reasoning (--reasoning-parser); without one it is accepted and ignored."""
    if thinking is None:
        return {}
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    if kind == "disabled":
        return {"chat_template_kwargs": {"enable_thinking": False}}
    if kind not in ("enabled", "adaptive", "between_tools"):
        raise bad_request('thinking must be {"type": "enabled", "budget_tokens": N}, '
                          '{"type": "adaptive"} or {"type": "disabled"}', "thinking")
    budget = thinking.get("budget_tokens")
    if kind == "enabled" and not (is_int(budget) and budget >= 1):
        raise bad_request("thinking.budget_tokens must be a positive integer",
                          "thinking.budget_tokens")
    out: dict[str, Any] = {"chat_template_kwargs": {"enable_thinking": True}}
    if reasoning and kind == "enabled":
        out["thinking_token_budget"] = budget
    if thinking.get("display") == "omitted":
        out["include_reasoning"] = False
    return out


def _output(config: Any) -> dict:
    """output_config.format (a JSON schema the text must follow) as response_format;
    `effort` as reasoning_effort (the chat template's variable, as the Responses API's
    reasoning.effort; vLLM's mapping)."""
    if config is None:
        return {}
    if not isinstance(config, dict):
        raise bad_request(f"output_config must be an object, got {json_type(config)}",
                          "output_config")
    effort = config.get("effort")
    if effort is not None and not isinstance(effort, str):
        raise bad_request("output_config.effort must be a string", "output_config.effort")
    out = {} if effort is None else {"reasoning_effort": effort}
    fmt = config.get("format")
    if fmt is None:
        return out
    if not (isinstance(fmt, dict) and fmt.get("type") == "json_schema"
            and isinstance(fmt.get("schema"), dict)):
        raise bad_request('output_config.format must be {"type": "json_schema", "schema": '
                          '{...}}', "output_config.format")
    return {**out, "response_format": {"type": "json_schema", "json_schema": {
        "name": "output", "schema": fmt["schema"]}}}
