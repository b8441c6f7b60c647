"""A one-line progress bar on stderr (rewritten in place on a terminal; else a line per 10%)."""

from __future__ import annotations

import sys
import time
from typing import TextIO

WIDTH = 30
MIN_INTERVAL_S = 0.1


class Progress:
    def __init__(self, total: int, label: str = "requests", enabled: bool = True,
                 stream: TextIO | None = None):
        self.total, self.label, self.enabled = total, label, enabled and total > 0
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.done = self.failed = 0
        self.start = time.monotonic()
        self._shown = 0.0
        self._decile = 0

    def update(self, ok: bool) -> None:
        self.done += 1
        self.failed += 0 if ok else 1
        if not self.enabled:
            return
        if self.tty:
            now = time.monotonic()
            if now - self._shown >= MIN_INTERVAL_S or self.done == self.total:
                self._shown = now
                self.stream.write("\r" + self.line())
                self.stream.flush()
        elif self.done * 10 // self.total > self._decile:
            self._decile = self.done * 10 // self.total
            self.stream.write(self.line() + "\n")
            self.stream.flush()

    def line(self) -> str:
        filled = WIDTH * self.done // self.total
        return (f"{self.label} [{'#' * filled}{'.' * (WIDTH - filled)}] {self.done}/{self.total}"
                f"  failed {self.failed}  {time.monotonic() - self.start:.1f}s")

    def close(self) -> None:
        if self.enabled and self.tty:
            self.stream.write("\n")
            self.stream.flush()
