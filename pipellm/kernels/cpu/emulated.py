"""The AMX kernels on emulated tiles, so that tests check their logic on a CPU without AMX:
their own sources built as a module of their own with PIPELLM_AMX_EMULATE (pipellm/kernels/cpu/
amx_emulate.h stands in for the tile instructions; the rest of their code, AVX-512 with
AVX512-BF16, runs natively). Slow, and never used by the product: built at -O1, which
builds in two thirds of -O3's time and runs the tests' small shapes as fast.

    runnable()  whether this CPU runs it (AVX512-BF16)
    module()    lora_delta(...) and prefill_attention(...) as the main module binds them,
                their AMX cases only
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

from pipellm.kernels.cpu import _FLAGS, _build_lock, isa

NAME = "pipellm_amx_emulated"
_SOURCES = ("amx_emulated.cpp", "lora.cpp", "lora_amx.cpp", "prefill_attention.cpp",
            "prefill_attention_amx.cpp")


def runnable() -> bool:
    """Whether this CPU runs the kernels' vector code: AVX-512 with AVX512-BF16."""
    return "avx512" in isa.cpu_levels() and "avx512_bf16" in isa.cpu_flags()


@functools.cache
def module():
    """The emulated module, built once (or loaded from torch's extension cache); RuntimeError
    where not runnable(); a build error propagates."""
    if not runnable():
        raise RuntimeError(f"the emulated AMX kernels need AVX512-BF16 ({isa.describe()})")
    import ninja
    from torch.utils.cpp_extension import _get_build_directory, load

    os.environ["PATH"] = f"{ninja.BIN_DIR}{os.pathsep}{os.environ.get('PATH', '')}"
    here = Path(__file__).parent
    with _build_lock(Path(_get_build_directory(NAME, False))):
        return load(NAME, [str(here / s) for s in _SOURCES],
                    extra_cflags=[*_FLAGS, "-O1", "-DPIPELLM_AMX_EMULATE"],
                    extra_ldflags=["-fopenmp"], verbose=False)
