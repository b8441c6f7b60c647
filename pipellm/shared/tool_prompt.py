"""Tools for a model whose chat template renders none (llama.cpp's generic fallback, in the
Hermes format that `--tool-call-parser hermes` reads): the tools and how to call them go into
the system message, earlier calls into the assistant's text as `<tool_call>` blocks, tool
results into a user turn of `<tool_response>` blocks; the model's own template renders the
rest as it always does.

`tool_parser_for(template_source)` names the parser a template's own tool format needs, for a
server started without --tool-call-parser; `auto_tool_parser` applies the flags' rules. Pure
logic, no I/O.
"""

from __future__ import annotations

import json

INSTRUCTIONS = (
    "You may call one or more functions to assist with the user query. The available "
    "functions, inside <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\nFor each "
    "function call, return a JSON object with the function name and its arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, "
    "\"arguments\": <args-json-object>}}\n</tool_call>")


_FORMATS = (("[TOOL_CALLS]", "mistral"), ("<function=", "qwen3_coder"),
            ("[func_name1(", "pythonic"), ("<|python_tag|>", "llama3_json"),
            ("ipython", "llama3_json"))


def tool_parser_for(source: str | None) -> str:
    """The tool-call parser for a chat template, by the format it teaches: mistral's
    `[TOOL_CALLS]`, Qwen3-Coder's `<function=`, the pythonic templates' `[func_name1(`, Llama
    3's `<|python_tag|>` and ipython turns (llama3_json); else hermes (the `<tool_call>` JSON
    blocks of Qwen, Hermes and this module's own fallback)."""
    return next((name for mark, name in _FORMATS if source and mark in source), "hermes")


def auto_tool_parser(svc, template_source: str | None) -> str:
    """The parser of tool_choice "auto" on a server (a ServiceConfig), "" where auto is off:
    --enable-auto-tool-choice unset means on, unless --tool-call-parser was given without it
    (vLLM's rule); the parser is --tool-call-parser's, else the template's own format."""
    auto = svc.enable_auto_tool_choice
    if auto is None:
        auto = not svc.tool_call_parser
    return (svc.tool_call_parser or tool_parser_for(template_source)) if auto else ""


def describe(svc, template) -> str:
    """The banner's line on tools (`template`: a ChatTemplate, or None without one)."""
    if template is None:
        return "tools: none (the model has no chat template)"
    parser = auto_tool_parser(svc, template.source)
    how = ("rendered by its chat template" if template.renders_tools
           else "described in the system message (its chat template renders none)")
    return f"tools: {how}; tool_choice auto {'parsed as ' + parser if parser else 'off'}"


def _call_text(call: dict) -> str:
    fn = call["function"]
    args = fn["arguments"] if isinstance(fn["arguments"], str) else json.dumps(
        fn["arguments"], ensure_ascii=False)
    return f'<tool_call>\n{{"name": {json.dumps(fn["name"])}, "arguments": {args}}}\n</tool_call>'


def with_tools(messages: list[dict], tools: list[dict]) -> list[dict]:
    """`messages` (template_message dicts) rewritten for a template that renders no tools:
    the tools in the system message (the first, or a new one), calls and results as text.
    Consecutive tool results make one user turn."""
    listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    system = INSTRUCTIONS.format(tools=listing)
    out: list[dict] = []
    if messages and messages[0]["role"] in ("system", "developer"):
        first, *messages = messages
        out.append({**first, "role": "system",
                    "content": f"{first.get('content') or ''}\n\n{system}".lstrip()})
    else:
        out.append({"role": "system", "content": system})
    for m in messages:
        if m["role"] == "tool":
            block = f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"
            if out[-1].get("tool_results"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "tool_results": True})
        elif m.get("tool_calls"):
            text = "\n".join([m.get("content") or "", *map(_call_text, m["tool_calls"])])
            out.append({"role": m["role"], "content": text.strip()})
        else:
            out.append({k: v for k, v in m.items() if k != "tool_calls"})
    return [{k: v for k, v in m.items() if k != "tool_results"} for m in out]


def tool_dicts(specs) -> list[dict] | None:
    """ToolSpecs as a chat template's `tools=` takes them (OpenAI's shape); None for none."""
    if not specs:
        return None
    return [{"type": "function", "function": {
        "name": t.name, "description": t.description,
        "parameters": json.loads(t.parameters)}} for t in specs]


def render_chat(template, messages: list[dict], add_generation_prompt: bool,
                tools: list[dict] | None, extra: dict | None, continue_final: bool) -> str:
    """`messages` rendered by `template` (pipellm/shared/chat_template.ChatTemplate), the tools in
    the system message where the template renders none (`with_tools`)."""
    if tools and not template.renders_tools:
        messages, tools = with_tools(messages, tools), None
    return template.render(messages, add_generation_prompt, tools, extra, continue_final)
