"""The open-files limit a server needs: one descriptor per client connection, per Redis
connection and per socket, so a burst of a thousand streams needs more than the soft limit
many hosts start processes with (1024). Raised as vLLM's and SGLang's servers raise it."""

from __future__ import annotations

import logging
import resource

log = logging.getLogger(__name__)
TARGET = 65535  # vLLM's target soft limit


def raise_open_files_limit(target: int = TARGET) -> int:
    """Raise this process's soft RLIMIT_NOFILE to `target`, or to the hard limit if that is
    lower (never lowers it); children started afterwards inherit it. Returns the soft limit
    in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = target if hard == resource.RLIM_INFINITY else min(target, hard)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            return want
        except (ValueError, OSError) as e:
            log.warning("open-files limit stays %d (could not raise it to %d: %s); a burst "
                        "of more connections than that fails", soft, want, e)
    return soft
