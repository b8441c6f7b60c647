"""Chat templates: messages -> prompt text, rendered exactly as transformers does.

A model directory carries its template in `tokenizer_config.json` (`chat_template`, either a
string or a list of {"name", "template"} of which "default" is used) or, in newer Hugging Face
repos, in a standalone `chat_template.jinja` (which wins when present). The template is Jinja2,
rendered in the same sandbox with the same helpers as `apply_chat_template(tokenize=False)`.

The rendered text already contains BOS when the template emits it, so it must be encoded
without the tokenizer's own special tokens: `ChatTemplate.add_special_tokens` is False (as in
vLLM and transformers); `ChatTemplate.encode` does that.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

from pipellm.shared.gguf.hf import tokenizer_config
from pipellm.shared.gguf.reader import is_gguf, open_gguf
from pipellm.shared.messages import ChatMessage
from pipellm.shared.tokenizer import encode

CONFIG_FILE = "tokenizer_config.json"
JINJA_FILE = "chat_template.jinja"
_SPECIAL = ("bos_token", "eos_token", "unk_token", "pad_token")


class ChatTemplateError(ValueError):
    """The template cannot be loaded or rendered (for the gateway: a 400 naming the problem)."""


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # transformers' override: no HTML escaping, json.dumps options exposed
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _TemplateDict:
    """`dict` inside templates, without attribute access to the real type (as transformers)."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """`namespace()` that refuses underscore-prefixed attributes (as transformers)."""

    def __init__(*args, **kwargs):  # same signature trick as jinja's Namespace
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot set underscore-prefixed attributes ({name!r})")


@lru_cache(maxsize=32)
def _compile(source: str) -> jinja2.Template:
    """Compile `source` in transformers' sandbox; raises ChatTemplateError on a syntax error."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _Namespace
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"invalid chat template (line {exc.lineno}): {exc.message}") \
            from None


@dataclass(frozen=True)
class ChatTemplate:
    """A model's chat template plus the special-token strings it may refer to."""

    source: str
    bos_token: str | None = None
    eos_token: str | None = None
    extra_tokens: dict[str, str] = field(default_factory=dict)  # unk_token, pad_token if set
    # The rendered text carries BOS (if the model wants one) itself: encode it without adding.
    add_special_tokens: bool = False

    def __post_init__(self):
        _compile(self.source)  # fail at load time, not on the first request

    @property
    def renders_tools(self) -> bool:
        """Whether the template reads `tools` (else a request's tools would be dropped)."""
        return "tools" in jinja2.meta.find_undeclared_variables(
            _compile(self.source).environment.parse(self.source))

    def render(self, messages: list[dict], add_generation_prompt: bool = True,
               tools: list[dict] | None = None, extra: dict | None = None,
               continue_final: bool = False) -> str:
        """The prompt text for `messages` ({"role", "content", ...} dicts), as transformers'
        `apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=...,
        continue_final_message=..., **extra)` renders it (`extra`: vLLM's chat_template_kwargs,
        such as enable_thinking). Raises ChatTemplateError when the messages are malformed or
        the template rejects them (e.g. `raise_exception("...")` for an unsupported role)."""
        chat = _clean_messages(messages)
        if "developer" not in self.source:  # OpenAI's newer name for system (as llama.cpp)
            chat = [{**m, "role": "system"} if m.get("role") == "developer" else m for m in chat]
        variables = {**self.extra_tokens, "bos_token": self.bos_token,
                     "eos_token": self.eos_token}
        variables = {"documents": None, **(extra or {}),  # vLLM's documents come in `extra`
                     **{k: v for k, v in variables.items() if v is not None}}
        try:
            text = _compile(self.source).render(
                messages=chat, tools=tools, add_generation_prompt=add_generation_prompt,
                **variables)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat template error: {exc}") from None
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
            raise ChatTemplateError(f"chat template failed on these messages: {exc}") from None
        return _cut_after_final(text, chat[-1]) if continue_final else text

    def encode(self, tokenizer, messages: list[dict], add_generation_prompt: bool = True
               ) -> list[int]:
        """Token ids of the rendered prompt (a `tokenizers.Tokenizer`), no special tokens added."""
        text = self.render(messages, add_generation_prompt)
        return encode(tokenizer, text, add_special_tokens=self.add_special_tokens)


def _cut_after_final(text: str, final: dict) -> str:
    """`text` ending where the final message's content does (transformers'
    continue_final_message: what the template adds after it, its end-of-turn, is cut)."""
    content = final.get("content")
    if not isinstance(content, str) or not content.strip():
        raise ChatTemplateError("continue_final_message needs a final message with text")
    at = text.rfind(content.strip())
    if at < 0:
        raise ChatTemplateError("continue_final_message: the template does not render the "
                                "final message's text as given")
    kept = content.lstrip()  # its trailing spaces, where the template kept them
    if text[at : at + len(kept)] == kept:
        return text[: at + len(kept)]
    return text[: at + len(content.strip())]


def template_message(m: ChatMessage) -> dict:
    """A chat message as templates take it: assistant calls' arguments as objects (HF's
    convention; the API sends JSON text), None fields left out by `render`."""
    calls = [{"id": c.id, "type": "function", "function": {
        "name": c.name, "arguments": _json_or_text(c.arguments)}} for c in m.tool_calls]
    return {"role": m.role, "content": m.content, "tool_calls": calls or None,
            "tool_call_id": m.tool_call_id, "name": m.name, "reasoning_content": m.reasoning}


def _json_or_text(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text


def _clean_messages(messages: list[dict]) -> list[dict]:
    """Plain-dict copies with None-valued keys dropped, as transformers does."""
    if not isinstance(messages, list | tuple) or not messages:
        raise ChatTemplateError("messages must be a non-empty list")
    out = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise ChatTemplateError(f"message {i} must be an object, got {type(msg).__name__}")
        out.append({k: v for k, v in msg.items() if v is not None})
    return out


def load_chat_template(model_dir: str | Path, override: str = "") -> ChatTemplate | None:
    """The chat template of a model directory (or of a GGUF file's `tokenizer.chat_template`),
    or None when it has none. `override` (--chat-template): a template file, or the template
    itself, used instead (the model's special tokens still fill it).

    Raises ChatTemplateError when a template is present but unusable (bad JSON, wrong type,
    Jinja syntax error, a list without a "default" entry, an override file that is missing).
    """
    root = Path(model_dir)
    if is_gguf(root):
        config = tokenizer_config(open_gguf(root))
        jinja_file = None
    else:
        config = _read_config(root / CONFIG_FILE)
        jinja_file = root / JINJA_FILE
    if override:
        source = _override_source(override)
    elif jinja_file is not None and jinja_file.is_file():
        source = jinja_file.read_text(encoding="utf-8")
    else:
        source = _pick_template(config.get("chat_template"))
    if source is None:
        return None
    return _with_tokens(source, config)


def request_template(model_dir: str | Path, source: str) -> ChatTemplate:
    """A chat request's own template (`source` is the template, never a path), filled with
    the model's special tokens; ChatTemplateError when it does not compile."""
    root = Path(model_dir)
    config = tokenizer_config(open_gguf(root)) if is_gguf(root) else _read_config(
        root / CONFIG_FILE)
    return _with_tokens(source, config)


def _with_tokens(source: str, config: dict) -> ChatTemplate:
    tokens = {k: _token_str(config.get(k)) for k in _SPECIAL}
    extra = {k: v for k, v in tokens.items() if v is not None and k in ("unk_token", "pad_token")}
    return ChatTemplate(source, tokens["bos_token"], tokens["eos_token"], extra)


BUILT_IN = Path(__file__).with_name("templates")  # --chat-template NAME: BUILT_IN/NAME.jinja


def _override_source(value: str) -> str:
    """--chat-template's text: a file's contents, a built-in template's (its name: chatml_tools),
    or the value itself when it reads as a template (vLLM's rule: Jinja or a line break in it)
    rather than a path."""
    path = Path(value)
    if value.isidentifier() and (BUILT_IN / f"{value}.jinja").is_file():
        path = BUILT_IN / f"{value}.jinja"
    try:
        if path.is_file():
            return path.read_text(encoding="utf-8")
    except (OSError, ValueError):  # a template too long or odd to be a path
        pass
    if any(c in value for c in "{}\n"):
        return value
    raise ChatTemplateError(f"--chat-template {value!r} is neither a file nor a template")


def _read_config(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ChatTemplateError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise ChatTemplateError(f"{path} must hold a JSON object")
    return config


def _pick_template(value: Any) -> str | None:
    """`chat_template` of tokenizer_config.json: a string, or a list of named templates."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        if isinstance(named.get("default"), str):
            return named["default"]
        raise ChatTemplateError(
            f"chat_template lists {sorted(map(str, named))} but no 'default' template")
    raise ChatTemplateError(f"chat_template must be a string or a list, not {type(value)}")


def _token_str(value: Any) -> str | None:
    """A special token as a string: plain, or an AddedToken-like dict with "content"."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None
