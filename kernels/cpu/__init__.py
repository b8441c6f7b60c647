"""C++ kernels for the CPU path, built on first use with torch's extension loader (ninja + the
machine's C++ compiler, cached under ~/.cache/torch_extensions; ~50 s the first time).

They do what a Python loop over sequences does slowly on a CPU (per-call dispatch overhead is
most of a decode step there). Each has the same PyTorch reference as its Triton twin. Where the
build fails (no compiler), `extension()` says so once in the log and returns None, and callers
fall back to the reference.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

log = logging.getLogger(__name__)
_SOURCES = [Path(__file__).with_name("decode_attention.cpp")]
_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp"]
_lock = threading.Lock()


_state: dict = {}  # "module" once built, "error" once the build failed: both are final


def _build():
    import ninja
    from torch.utils.cpp_extension import load

    # torch finds ninja on PATH; a venv's console script does not put its bin/ there
    os.environ["PATH"] = f"{ninja.BIN_DIR}{os.pathsep}{os.environ.get('PATH', '')}"
    return load("pipellm_cpu_kernels", [str(s) for s in _SOURCES], extra_cflags=_FLAGS,
                extra_ldflags=["-fopenmp"], verbose=False)


def extension():
    """The compiled module (functions: decode_attention), or None when it cannot be built."""
    with _lock:
        if "module" not in _state and "error" not in _state:
            try:
                _state["module"] = _build()
            except Exception as exc:  # no compiler, or it failed: the reference still works
                _state["error"] = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                log.warning("C++ CPU kernels unavailable (%s); using the PyTorch reference",
                            _state["error"])
        return _state.get("module")
