"""Namespace tools of the Responses API (a group of functions under one name, as Codex sends an
MCP server's tools), as vLLM serves them: the model sees each function as
`<namespace>__<name>`; a call of one comes back as a `function_call` item with its own `name`
and its `namespace`, and a history's such item is that flat name again.
"""

from __future__ import annotations

SEPARATOR = "__"


def flat_name(namespace: str, name: str) -> str:
    return f"{namespace}{SEPARATOR}{name}"


def functions(tool: dict) -> list[dict]:
    """A namespace tool's function tools, each under its flat name."""
    inner = tool.get("tools")
    if not isinstance(inner, list):
        return []
    return [{**t, "name": flat_name(str(tool.get("name")), str(t.get("name")))}
            for t in inner if isinstance(t, dict) and t.get("type") == "function"]


def call_names(tools: list[dict]) -> dict[str, tuple[str, str]]:
    """Each namespaced function's flat name -> (its name, its namespace)."""
    return {flat_name(str(t.get("name")), str(f.get("name"))): (str(f.get("name")),
                                                               str(t.get("name")))
            for t in tools if t.get("type") == "namespace"
            for f in t.get("tools") or [] if isinstance(f, dict) and f.get("type") == "function"}


def history_name(item: dict, name: str) -> str:
    """A history's function_call name as the model saw it (flat where it has a namespace)."""
    namespace = item.get("namespace")
    return flat_name(namespace, name) if isinstance(namespace, str) and namespace else name
