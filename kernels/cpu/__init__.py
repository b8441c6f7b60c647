"""C++ kernels for the CPU path, built with torch's extension loader (ninja + the machine's C++
compiler, cached under $TORCH_EXTENSIONS_DIR, by default ~/.cache/torch_extensions; ~1.5 min
the first time on two cores, then a load of ~0.1 s).

`services/setup.sh` builds them once (`python -m kernels.cpu`), and the compute service builds or
loads them at start-up, before it reports ready (`build()`), so no request waits for a compiler.

They do in one call what the PyTorch reference does in a Python loop over sequences or in
dozens of tiny ops (per-op dispatch overhead is most of a decode step on a CPU). Each has the same
PyTorch reference as its Triton twin. Where the build fails (no compiler), `extension()` says so
once in the log and returns None, and callers fall back to the reference.

One module, one source per concept (bindings.cpp declares and binds them all):

    decode_attention.cpp  decode_attention(q, k_cache, v_cache, starts, lens, scale[, k_scale,
                          v_scale, window])                  kernels/decode_attention.py
    norm.cpp              rms_norm, add_rms_norm, rms_norm_int8     kernels/rmsnorm.py
    activation.cpp        silu_mul                                  kernels/activation.py
    int8_quant.cpp        quantize_int8, silu_mul_int8              kernels/int8_quant.py
    rope.cpp              rope_kv_write (float and INT8 caches)     kernels/rope.py
    token_bitmask.cpp     apply_token_bitmask (grammars' masks)     kernels/token_bitmask.py
    common.h              the row kernels' shared helpers
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

log = logging.getLogger(__name__)
_SOURCES = [Path(__file__).with_name(name) for name in (
    "bindings.cpp", "decode_attention.cpp", "norm.cpp", "activation.cpp", "int8_quant.cpp",
    "rope.cpp", "block_gemm.cpp", "token_bitmask.cpp", "sampling.cpp",
    "sampling_filters.cpp")]
_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp"]
_lock = threading.Lock()


# "module" once built, "error" once the build failed: both are final; "seconds" the build or
# load took, "compiled" whether it compiled (False: loaded from the cache)
_state: dict = {}


def _build():
    import ninja
    from torch.utils.cpp_extension import load

    # torch finds ninja on PATH; a venv's console script does not put its bin/ there
    os.environ["PATH"] = f"{ninja.BIN_DIR}{os.pathsep}{os.environ.get('PATH', '')}"
    return load("pipellm_cpu_kernels", [str(s) for s in _SOURCES], extra_cflags=_FLAGS,
                extra_ldflags=["-fopenmp"], verbose=False)


def extension():
    """The compiled module (functions: decode_attention, rms_norm, add_rms_norm, rms_norm_int8,
    silu_mul, quantize_int8, silu_mul_int8, rope_kv_write), or None when it cannot be built."""
    with _lock:
        if "module" not in _state and "error" not in _state:
            started, wall = time.monotonic(), time.time()
            try:
                module = _build()
            except Exception as exc:  # no compiler, or it failed: the reference still works
                _state["error"] = _why(exc)
                log.warning("C++ CPU kernels unavailable (%s); using the PyTorch reference",
                            _state["error"])
            else:
                # a .so written since we started was compiled now; an older one was cached
                _state["compiled"] = os.path.getmtime(module.__file__) >= wall - 1.0
                _state["module"] = module
                how = f"compiled ({', '.join(s.name for s in _SOURCES)})" \
                    if _state["compiled"] else "loaded (cached)"
                log.info("C++ CPU kernels %s in %.1f s: %s", how, time.monotonic() - started,
                         module.__file__)
            _state["seconds"] = time.monotonic() - started
        return _state.get("module")


def _why(exc: Exception) -> str:
    """A build error in one line: torch's first line (without the ninja command line) and the
    compiler's first error."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    if not lines:
        return type(exc).__name__
    head = lines[0].split(": [", 1)[0]
    detail = next((line for line in lines[1:] if "error" in line.lower() or "not found" in line),
                  "")
    return f"{head}: {detail}" if detail else head


def build() -> str:
    """Build the kernels now (or load them from the cache) rather than on their first call, and
    say what happened: 'C++ CPU kernels built in 48.2 s', '... loaded (cached) in 0.1 s', or
    '... unavailable (why): the PyTorch reference runs instead'. Never raises for a failed
    build."""
    extension()
    if "error" in _state:
        return f"C++ CPU kernels unavailable ({_state['error']}): the PyTorch reference runs " \
               "instead"
    how = "built" if _state["compiled"] else "loaded (cached)"
    return f"C++ CPU kernels {how} in {_state['seconds']:.1f} s"
