"""A reasoning model's output split into reasoning and content, as vLLM's `--reasoning-parser`
does: the text between the think markers is reasoning, the rest content, the markers dropped.

    qwen3          reasoning only when the output opens with `<think>` (Qwen3 with thinking
                   off, or a template that closes it in the prompt, answers content only)
    deepseek_r1    the output starts in reasoning (the template opened it in the prompt; a
                   leading `<think>` is dropped): reasoning until `</think>`, all of it if none

SGLang's names are accepted too (`deepseek-r1`, `qwen3-thinking` = deepseek_r1's rule).
`Splitter` is the streaming form, fed the text as it is made: for any split of a text into
chunks, its outputs concatenate to `split(text)`'s. Pure logic, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

START, END = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningParser:
    """A family's rule: whether output starts inside the reasoning, and its markers."""

    name: str
    starts_in_reasoning: bool
    start: str = START
    end: str = END


_QWEN3 = ReasoningParser("qwen3", starts_in_reasoning=False)
_R1 = ReasoningParser("deepseek_r1", starts_in_reasoning=True)
PARSERS = {"qwen3": _QWEN3, "deepseek_r1": _R1, "deepseek-r1": _R1, "qwen3-thinking": _R1}


def parser(name: str) -> ReasoningParser:
    """The parser called `name` (ValueError naming the choices otherwise)."""
    try:
        return PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown reasoning parser {name!r}: choose from "
                         f"{', '.join(sorted(PARSERS))}") from None


def partial_marker(text: str, marker: str) -> int:
    """Length of the longest proper prefix of `marker` that `text` ends with (what a stream
    holds back: the marker may be arriving)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


class Splitter:
    """Streaming split: feed(text) -> (reasoning, content) released so far; flush() at the end.
    Text that may be the start of a marker is held back until it is known not to be."""

    def __init__(self, rule: ReasoningParser):
        self.rule = rule
        self.state = "reasoning" if rule.starts_in_reasoning else "opening"
        self.held = ""  # text not yet released (a possible marker prefix)
        self.opened = rule.starts_in_reasoning  # a leading start marker may still be dropped

    def feed(self, text: str) -> tuple[str, str]:
        reasoning, content = [], []
        buf, self.held = self.held + text, ""
        while buf:
            if self.state == "opening" or (self.opened and self.state == "reasoning"):
                stripped = buf.lstrip()
                if self.rule.start.startswith(stripped) and len(stripped) < len(self.rule.start):
                    self.held = buf  # still possibly the start marker
                    break
                self.opened = False
                if stripped.startswith(self.rule.start):
                    buf, self.state = stripped[len(self.rule.start):], "reasoning"
                    continue
                if self.state == "opening":
                    self.state = "content"
            if self.state == "content":
                content.append(buf)
                break
            i = buf.find(self.rule.end)
            if i >= 0:
                reasoning.append(buf[:i])
                buf, self.state = buf[i + len(self.rule.end):], "content"
                continue
            keep = partial_marker(buf, self.rule.end)
            reasoning.append(buf[:len(buf) - keep])
            self.held = buf[len(buf) - keep:]
            break
        return "".join(reasoning), "".join(content)

    def flush(self) -> tuple[str, str]:
        """The held-back text at the end: reasoning inside it, content otherwise."""
        held, self.held = self.held, ""
        return (held, "") if self.state == "reasoning" else ("", held)


def split(rule: ReasoningParser, text: str) -> tuple[str, str]:
    """(reasoning, content) of a whole output."""
    s = Splitter(rule)
    r1, c1 = s.feed(text)
    r2, c2 = s.flush()
    return r1 + r2, c1 + c2
