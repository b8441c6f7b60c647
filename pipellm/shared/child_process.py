"""What every child process pipellm starts shares: it dies with its parent."""

from __future__ import annotations

import ctypes
import signal

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Popen's preexec_fn (runs in the child between fork and exec): the kernel sends the child
    SIGTERM when the process that started it exits (Linux PR_SET_PDEATHSIG; elsewhere a no-op)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass
