"""C++ kernels for the CPU path, built with torch's extension loader (ninja + the machine's C++
compiler, cached under $TORCH_EXTENSIONS_DIR, by default ~/.cache/torch_extensions; ~2.5 min
the first time on two cores (bench/kernel_build.py), then a load of ~0.1 s).

`scripts/setup.sh` builds them once (`python -m pipellm.kernels.cpu`), and the compute service
builds or loads them at start-up, before it reports ready (`build()`), so no request waits for a
compiler.

They do in one call what the PyTorch reference does in a Python loop over sequences or in
dozens of tiny ops (per-op dispatch overhead is most of a decode step on a CPU). Each has the same
PyTorch reference as its Triton twin. Where the build fails (no compiler), `extension()` says so
once in the log and returns None, and callers fall back to the reference.

One module, one source per concept (ops.h declares them, bindings.cpp binds them all):

    decode_attention.cpp  decode_attention(q, k_cache, v_cache, starts, lens, scale[, k_scale,
                          v_scale, window])                  pipellm/kernels/decode_attention.py
    norm.cpp              rms_norm, add_rms_norm, rms_norm_int8     pipellm/kernels/rmsnorm.py
                          (norm_avx512.cpp: bf16 rows 16 wide)
    activation.cpp        silu_mul (activation_avx512.cpp: 16 wide)  pipellm/kernels/activation.py
    int8_quant.cpp        quantize_int8, silu_mul_int8              pipellm/kernels/int8_quant.py
    rope.cpp              rope_kv_write (float and INT8 caches)     pipellm/kernels/rope.py
    token_bitmask.cpp     apply_token_bitmask (grammars' masks)     pipellm/kernels/token_bitmask.py
    sampling.cpp          sample_rows: temperature / top-k / top-p / min-p without sorting the
                          vocabulary (sampling_filters.cpp: the cut-offs)
                          pipellm/kernels/sampling.py
    block_gemm.cpp        q4_gemm, q8_gemm: 4- and 8-bit weight blocks x INT8 activations, one
                          kernel per ISA level (block_gemm_<isa>.cpp)  pipellm/kernels/int4_gemm.py,
                                                                        pipellm/kernels/q8_gemm.py
    lora.cpp              lora_delta: the segmented LoRA delta, one variant per ISA level
                          (lora_<isa>.cpp, AMX tiles at the amx level)  pipellm/kernels/lora.py
    prefill_attention.cpp prefill_attention: causal prefill, one variant per ISA level
                          (prefill_attention_<isa>.cpp; bf16 on AMX tiles: _amx.cpp; a
                          pooling forward's bf16 products on AVX512-BF16: _avx512_bf16.cpp)
                                                             pipellm/kernels/prefill_attention.py
    decode_layers.cpp     DecodeStack, decode_layers: a decode step's layers in one call, the
                          kernels above chained     pipellm/services/compute/model/fused_decode.py
    common.h              the row kernels' shared helpers
    tensor.h              the ATen the sources include (not <torch/extension.h>, torch's
                          whole C++ frontend: minutes per source); bindings.cpp adds torch's
                          pybind11 headers
    amx_emulate.h         AMX tiles in plain C++: emulated.py builds the AMX kernels on them
                          as a test-only module, so any CPU with AVX512-BF16 tests them
    simd_<isa>.h          the float vector traits the vectorized kernels are templates over

One build for every x86 CPU from AVX2 up (`-march=x86-64-v3`, never -march=native, so a build or
a Docker image made on one CPU runs on another): the block GEMMs are compiled once per ISA level
(pipellm/kernels/cpu/isa.py) and the level the CPU runs (or PIPELLM_CPU_ISA's) is chosen at load. A
CPU below AVX2 loads nothing and runs the reference. Builds are serialized by an OS file lock, which
dies with its process: a torch build lock found under it was left by a killed build, and is
removed with a warning instead of waited on forever.
"""

from __future__ import annotations

import fcntl
import logging
import os
import threading
import time
from contextlib import contextmanager
from pathlib import Path

from pipellm.kernels.cpu import isa

log = logging.getLogger(__name__)
NAME = "pipellm_cpu_kernels"
_SOURCES = [Path(__file__).with_name(name) for name in (
    "bindings.cpp", "decode_attention.cpp", "norm.cpp", "activation.cpp", "int8_quant.cpp",
    "rope.cpp", "block_gemm.cpp", "block_gemm_avx2.cpp", "block_gemm_avx2_vnni.cpp",
    "block_gemm_avx512.cpp",
    "block_gemm_avx512_vnni.cpp", "decode_attention_avx2.cpp", "decode_attention_avx512.cpp",
    "token_bitmask.cpp", "sampling.cpp", "sampling_filters.cpp", "lora.cpp", "lora_avx2.cpp",
    "lora_avx512.cpp", "lora_amx.cpp", "prefill_attention.cpp", "prefill_attention_amx.cpp",
    "prefill_attention_avx2.cpp", "prefill_attention_avx512.cpp",
    "prefill_attention_avx512_bf16.cpp",
    "activation_avx512.cpp", "norm_avx512.cpp", "decode_layers.cpp")]
_FLAGS = ["-O3", *(["-march=x86-64-v3"] if isa.is_x86() else []), "-ffast-math", "-fopenmp"]
_lock = threading.Lock()


# "module" once built, "error" once the build failed: both are final; "seconds" the build or
# load took, "compiled" whether it compiled (False: loaded from the cache)
_state: dict = {}


@contextmanager
def _build_lock(build_dir: Path):
    """Hold the build of `build_dir` alone: an flock on a file beside it (released by the OS if
    its holder dies). Under it, torch's own lock file, which a killed build leaves behind and
    torch would wait on forever, can only be stale: it is removed, with a warning."""
    with open(build_dir.with_name(build_dir.name + ".pipellm-lock"), "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            log.warning("waiting for another process (pid %s) building the C++ CPU kernels in %s",
                        f.read().strip() or "?", build_dir)
            fcntl.flock(f, fcntl.LOCK_EX)
        f.truncate(0)
        f.write(str(os.getpid()))
        f.flush()
        stale = build_dir / "lock"
        if stale.exists():
            log.warning("removed a stale build lock left by a killed kernel build: %s", stale)
            stale.unlink(missing_ok=True)
        yield


@contextmanager
def _still_building(period_s: float = 30.0):
    """While the body runs, say every `period_s` that the kernels are still being built (a first
    build compiles for minutes on few cores, and compute is not ready until it ends)."""
    done, started = threading.Event(), time.monotonic()

    def report():
        while not done.wait(period_s):
            log.info("still building the C++ CPU kernels (%d s so far; a first build compiles "
                     "%d sources, minutes on a few cores)", time.monotonic() - started,
                     len(_SOURCES))

    threading.Thread(target=report, name="kernel-build-progress", daemon=True).start()
    try:
        yield
    finally:
        done.set()


def _build():
    import ninja
    from torch.utils.cpp_extension import _get_build_directory, load

    if isa.is_x86() and not isa.cpu_levels():
        raise RuntimeError("this CPU lacks AVX2/FMA/F16C, the floor the kernels are built for")
    level = isa.selected()  # ValueError for a PIPELLM_CPU_ISA this CPU does not run
    # torch finds ninja on PATH; a venv's console script does not put its bin/ there
    os.environ["PATH"] = f"{ninja.BIN_DIR}{os.pathsep}{os.environ.get('PATH', '')}"
    with _build_lock(Path(_get_build_directory(NAME, False))):
        module = load(NAME, [str(s) for s in _SOURCES], extra_cflags=_FLAGS,
                      extra_ldflags=["-fopenmp"], verbose=False)
    module.set_block_gemm_isa(isa.block_gemm_level(level) or "")
    return module


def set_isa(requested: str) -> None:
    """Run the block GEMMs at ISA level `requested` (pipellm/kernels/cpu/isa.py: "auto" or a
    level this CPU runs; ValueError otherwise), in a module already loaded as in one loaded
    later."""
    isa.set_level(requested)
    if "module" in _state:
        _state["module"].set_block_gemm_isa(isa.block_gemm_level(isa.selected()) or "")


def extension():
    """The compiled module (bindings.cpp lists its functions), its block GEMMs set to the chosen
    ISA level, or None when it cannot be built or loaded on this CPU."""
    module = _state.get("module")  # once loaded, final: no lock on a kernel call's path
    if module is not None:
        return module
    with _lock:
        if "module" not in _state and "error" not in _state:
            started, wall = time.monotonic(), time.time()
            try:
                with _still_building():
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
                log.info("C++ CPU kernels %s in %.1f s: %s; block GEMMs: %s", how,
                         time.monotonic() - started, module.__file__, isa.describe())
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
    return f"C++ CPU kernels {how} in {_state['seconds']:.1f} s, ISA {isa.describe()}"
