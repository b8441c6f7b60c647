"""A JSON grammar whose whitespace between tokens follows a regex (vLLM's `whitespace_pattern`).

xgrammar's JSON-schema grammars take no whitespace pattern (only any whitespace or none), so the
schema's grammar is built with any whitespace, printed as EBNF, and every `[ \\n\\r\\t]*` in
it (xgrammar's whitespace between JSON tokens) becomes a reference to the pattern's own rules
(the regex as EBNF, from xgrammar, its rules renamed apart). The lookahead that ends a string
(`(=([ \\n\\r\\t]* [,}\\]:]))`) is left as it is: it checks what may follow a string, a superset
of any whitespace pattern made of whitespace.

    json_with_whitespace(grammar, pattern) -> Grammar
"""

from __future__ import annotations

import re

ANY_WS = "[ \\n\\r\\t]*"  # xgrammar's JSON whitespace, as its EBNF prints it
_LOOKAHEAD = "(=(" + ANY_WS + " [,}\\]:]))"
_PREFIX = "ws_pattern_"
_RULE = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*) ::=", re.M)
_TOKEN = re.compile(r'"(?:\\.|[^"\\])*"|\[(?:\\.|[^\]\\])*\]|[A-Za-z_][A-Za-z0-9_]*|.', re.S)


def _renamed(ebnf: str, names: set[str]) -> str:
    """`ebnf` with each rule name in `names` prefixed, string literals and character
    classes left alone."""
    return "".join(_PREFIX + t if t in names else t for t in _TOKEN.findall(ebnf))


def json_with_whitespace(grammar, pattern: str):
    """xgrammar Grammar: `grammar` (a JSON grammar built with any whitespace) with its
    whitespace between tokens matching `pattern` instead. Raises ValueError if `grammar`
    has no whitespace of xgrammar's form where a JSON grammar has some (so that a change of
    xgrammar's printing cannot pass unnoticed)."""
    import xgrammar as xgr

    try:
        ws = str(xgr.Grammar.from_regex(pattern))
    except Exception as e:  # xgrammar's reason, as its first line
        raise ValueError(f"whitespace_pattern: {str(e).strip().splitlines()[0]}") from None
    ws = _renamed(ws, set(_RULE.findall(ws)))
    text = str(grammar).replace(_LOOKAHEAD, "\0")
    if ANY_WS not in text and "\"{\"" in text:  # an object, yet no whitespace found
        raise ValueError("xgrammar's JSON grammar has no whitespace rule to replace")
    text = text.replace(ANY_WS, _PREFIX + "root").replace("\0", _LOOKAHEAD)
    return xgr.Grammar.from_ebnf(text + "\n" + ws, root_rule_name="root")
