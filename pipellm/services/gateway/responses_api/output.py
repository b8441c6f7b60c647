"""A response's output as it is generated: its items (reasoning, message, function calls) and
the Responses API's stream events, built from one choice's Deltas.

    response.created, response.in_progress                       (by `start`)
    per output item, numbered 0, 1, ... in order:
        response.output_item.added
        reasoning: response.reasoning_text.delta ... .done
        message:   response.content_part.added, response.output_text.delta ... .done,
                   response.content_part.done
        function_call: response.function_call_arguments.delta ... .done
        response.output_item.done
    response.completed | response.incomplete (max_output_tokens) | response.failed

Invariants: every event carries the next `sequence_number` (0, 1, ...); at most one item is
open and it is done before the next is added and before the last event; the items' texts and
arguments are the concatenation of their deltas, and the final response's output is these
items, so a streamed response reassembles to the stored one.
"""

from __future__ import annotations

import copy
import time

from pipellm.services.gateway import responses
from pipellm.services.gateway.protocol import GenerationRequest
from pipellm.services.gateway.responses_api import custom_tools, namespaces
from pipellm.services.gateway.tool_parsers import CallArgs, CallStart, Content

Event = dict


class ResponseOutput:
    """The output and the events of one response (`obj`: the Response object so far, its
    output empty). Item and call ids are derived from the response's id and their order, so
    the same deltas give the same events and items every time."""

    def __init__(self, req: GenerationRequest, obj: dict):
        self.req, self.obj = req, obj
        self.base = obj["id"].removeprefix("resp_")
        self.shaper = req.tools.shaper() if req.tools is not None else None
        self.items: list[dict] = obj["output"]
        self.open: dict | None = None  # the item being generated
        self.seq = 0
        self.calls: dict[int, dict] = {}  # the shaper's call index -> its item
        self.custom = custom_tools.custom_names(obj.get("tools") or [])
        self.namespaced = namespaces.call_names(obj.get("tools") or [])
        self.arguments: dict[str, str] = {}  # a custom call's item id -> its arguments so far

    def event(self, kind: str, **fields) -> Event:
        out = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return out

    def start(self) -> list[Event]:
        return [self.event("response.created", response=self.snapshot()),
                self.event("response.in_progress", response=self.snapshot())]

    def snapshot(self) -> dict:
        return {**self.obj, "output": [dict(i) for i in self.items]}

    def feed(self, reasoning: str, text: str, logprobs: list | None,
             last: bool) -> list[Event]:
        """Events of a delta: its reasoning, then its text (through the tool shaper)."""
        out: list[Event] = []
        if reasoning:
            out += self._text("reasoning", reasoning, None)
        pieces = [Content(text)] if self.shaper is None else self.shaper.feed(text)
        if last and self.shaper is not None:
            pieces += self.shaper.finish()
        for piece in pieces:
            if isinstance(piece, Content) and (piece.text or logprobs):
                out += self._text("message", piece.text, logprobs)
                logprobs = None
            elif isinstance(piece, CallStart):
                out += self._close()
                self.calls[piece.index] = item = self._call_item(piece.name)
                out += self._add(item)
            elif isinstance(piece, CallArgs):
                out += self._call_args(self.calls[piece.index], piece.fragment)
        return out

    def _call_item(self, name: str) -> dict:
        """A new call's item: a function_call, or a custom tool's custom_tool_call."""
        if name in self.custom:
            item = {"type": "custom_tool_call", "id": self._new_id("ctc"),
                    "call_id": self._new_id("call"), "name": name, "input": "",
                    "status": "in_progress"}
            self.arguments[item["id"]] = ""
            return item
        item = {"type": "function_call", "id": self._new_id("fc"),
                "call_id": self._new_id("call"), "name": name, "arguments": "",
                "status": "in_progress"}
        if name in self.namespaced:  # its own name, and the namespace it is in
            item["name"], item["namespace"] = self.namespaced[name]
        return item

    def _call_args(self, item: dict, fragment: str) -> list[Event]:
        """A piece of a call's arguments: a function's as it is, a custom tool's as the part
        of its input string it completes."""
        index = self._index(item)
        if item["type"] == "function_call":
            item["arguments"] += fragment
            return [self.event("response.function_call_arguments.delta", item_id=item["id"],
                               output_index=index, delta=fragment)]
        self.arguments[item["id"]] += fragment
        return self._input_delta(item, custom_tools.input_prefix(self.arguments[item["id"]]))

    def _input_delta(self, item: dict, text: str) -> list[Event]:
        """The custom call's input grown to `text` (a delta event), if it grew."""
        delta = text[len(item["input"]):] if text.startswith(item["input"]) else ""
        if not delta:
            return []
        item["input"] += delta
        return [self.event("response.custom_tool_call_input.delta", item_id=item["id"],
                           output_index=self._index(item), delta=delta)]

    def finish(self, status: str, usage: dict, error: dict | None = None) -> list[Event]:
        """The closing events: the open item done, then the response's end."""
        out = self._close()
        self.obj.update(status=status, usage=usage, error=error, output=self.items)
        if status == "incomplete":
            self.obj["incomplete_details"] = {"reason": "max_output_tokens"}
        if status == "completed":
            self.obj["completed_at"] = int(time.time())
        kind = {"completed": "response.completed", "incomplete": "response.incomplete",
                "cancelled": "response.cancelled"}.get(status, "response.failed")
        return out + [self.event(kind, response=self.snapshot())]

    def _new_id(self, prefix: str) -> str:
        return f"{prefix}_{self.base}_{len(self.items)}"

    def _index(self, item: dict) -> int:
        return next(i for i, x in enumerate(self.items) if x is item)

    def _add(self, item: dict) -> list[Event]:
        self.items.append(item)
        self.open = item
        return [self.event("response.output_item.added", output_index=len(self.items) - 1,
                           item=copy.deepcopy(item))]

    def _text(self, kind: str, text: str, logprobs: list | None) -> list[Event]:
        out: list[Event] = []
        if self.open is None or self.open["type"] != kind:
            out += self._close()
            if kind == "reasoning":
                item = {"type": "reasoning", "id": self._new_id("rs"), "summary": [],
                        "content": [], "status": "in_progress"}
                out += self._add(item)
                part = {"type": "reasoning_text", "text": ""}
            else:
                item = {"type": "message", "id": self._new_id("msg"), "role": "assistant",
                        "status": "in_progress", "content": []}
                out += self._add(item)
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            out.append(self.event("response.content_part.added", item_id=item["id"],
                                  output_index=len(self.items) - 1, content_index=0,
                                  part=copy.deepcopy(part)))
            item["content"].append(part)
        item = self.open
        part = item["content"][0]
        part["text"] += text
        fields = dict(item_id=item["id"], output_index=len(self.items) - 1, content_index=0,
                      delta=text)
        if kind == "message":
            part["logprobs"] += logprobs or []
            out.append(self.event("response.output_text.delta", logprobs=logprobs or [],
                                  **fields))
        else:
            out.append(self.event("response.reasoning_text.delta", **fields))
        return out

    def _close(self) -> list[Event]:
        item, self.open = self.open, None
        if item is None:
            return []
        index = self._index(item)
        item["status"] = "completed"
        out = []
        if item["type"] == "function_call":
            out.append(self.event("response.function_call_arguments.done", item_id=item["id"],
                                  output_index=index, name=item["name"],
                                  arguments=item["arguments"]))
        elif item["type"] == "custom_tool_call":
            final = custom_tools.decode_input(self.arguments.pop(item["id"]))
            out += self._input_delta(item, final)
            item["input"] = final
            out.append(self.event("response.custom_tool_call_input.done", item_id=item["id"],
                                  output_index=index, input=final))
        else:
            part = item["content"][0]
            kind = "output_text" if item["type"] == "message" else "reasoning_text"
            done = dict(item_id=item["id"], output_index=index, content_index=0,
                        text=part["text"])
            if kind == "output_text":
                done["logprobs"] = part["logprobs"]
            out.append(self.event(f"response.{kind}.done", **done))
            out.append(self.event("response.content_part.done", item_id=item["id"],
                                  output_index=index, content_index=0, part=copy.deepcopy(part)))
        out.append(self.event("response.output_item.done", output_index=index,
                              item=copy.deepcopy(item)))
        return out


def logprobs_of(entries: list[responses.TokenLogprob]) -> list[dict]:
    """A delta's logprob entries as output_text logprobs ({token, logprob, bytes,
    top_logprobs})."""
    return responses.chat_logprobs(entries)["content"] if entries else []


def usage(input_tokens: int, output_tokens: int, cached: int, reasoning_tokens: int) -> dict:
    return {"input_tokens": input_tokens,
            "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": output_tokens,
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": input_tokens + output_tokens}
