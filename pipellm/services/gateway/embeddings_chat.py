"""Chat conversations as embedding inputs (vLLM's chat embeddings requests), validated.

A conversation is a list of chat messages (chat_messages.py). `/v1/embeddings` and `/pooling`
take one in `messages` or as `input`, or a batch: a list of conversations in either. The
tokenizer renders each with the model's chat template and embeds the text (tokenizer/embed.py).
The options are vLLM's for these requests, with its defaults: `add_generation_prompt` false,
`continue_final_message` false, `chat_template_kwargs` (template variables), and
`add_special_tokens` false (the template writes them). A request's own `chat_template` is a 400
here: the pooling APIs render with the model's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pipellm.services.gateway.chat_messages import parse_messages
from pipellm.services.gateway.chat_settings import prompt_end, template_kwargs
from pipellm.services.gateway.errors import bad_request
from pipellm.services.gateway.validation import json_type
from pipellm.shared.messages import ChatMessage

KEYS = frozenset({"messages", "add_generation_prompt", "continue_final_message",
                  "chat_template_kwargs", "chat_template"})
MAX_CONVERSATIONS = 2048  # as many as /v1/embeddings takes inputs


@dataclass(frozen=True)
class ChatInputs:
    """Validated conversations and how they render (the EmbedRequest's fields of that name)."""

    conversations: tuple[tuple[ChatMessage, ...], ...]
    add_generation_prompt: bool = False
    continue_final_message: bool = False
    chat_template_kwargs: str = ""  # a JSON object, or ""


def is_conversation(value: Any) -> bool:
    """Whether `value` reads as one conversation: a non-empty list of objects with a role."""
    return (isinstance(value, list) and bool(value)
            and all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in value))


def parse_chat_inputs(body: dict, ignored: list[str] | None) -> ChatInputs | None:
    """The body's conversations (`messages`, or `input` shaped as conversations), or None
    where it sends none."""
    value, param = body.get("messages"), "messages"
    if value is None:
        value, param = body.get("input"), "input"
        if not (is_conversation(value) or (isinstance(value, list) and bool(value)
                                           and all(is_conversation(c) for c in value))):
            return None
    elif body.get("input") is not None:
        raise bad_request("give either input or messages, not both", "messages")
    if body.get("chat_template") is not None:
        raise bad_request("`chat_template` is not supported by the pooling APIs (they render "
                          "with the model's template)", "chat_template")
    batch = [value] if is_conversation(value) else value
    if not isinstance(batch, list) or not batch:
        raise bad_request(f"{param} must be a conversation (a list of messages) or a list of "
                          f"them, got {json_type(value)}", param)
    if len(batch) > MAX_CONVERSATIONS:
        raise bad_request(f"{param} holds at most {MAX_CONVERSATIONS} conversations, got "
                          f"{len(batch)}", param)
    conversations = tuple(parse_messages(c, ignored) for c in batch)
    kwargs = template_kwargs(body)
    continue_final, add_prompt = prompt_end(body, False)
    return ChatInputs(conversations, add_prompt, continue_final,
                      json.dumps(kwargs) if kwargs else "")
