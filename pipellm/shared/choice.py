"""A choice's id on the wire: '<api id>:<index>', and once a restart made it resume under
attempt a, '<api id>:<index>.<a>'. An API id holds no ':' (the gateway makes it so)."""

from __future__ import annotations

from typing import NamedTuple


class ChoiceId(NamedTuple):
    api: str
    index: int
    attempt: int = 0

    @classmethod
    def parse(cls, text: str) -> ChoiceId:
        """The choice `text` names; an API id alone names its choice 0."""
        api, colon, rest = text.rpartition(":")
        if not colon:
            return cls(text, 0)
        index, _, attempt = rest.partition(".")
        return cls(api, int(index), int(attempt or 0))

    def __str__(self) -> str:
        tail = f".{self.attempt}" if self.attempt else ""
        return f"{self.api}:{self.index}{tail}"


def api_id(request_id: str) -> str:
    """The API request a choice (or the API request itself) belongs to."""
    return request_id.rpartition(":")[0] or request_id
